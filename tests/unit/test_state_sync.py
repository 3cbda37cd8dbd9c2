"""Who sends the state when a generation forms (elasticctl.train.sync), table-tested."""

from __future__ import annotations

import pytest

from elasticctl.train.sync import SyncPlan, plan_state_sync

T, F = True, False


@pytest.mark.parametrize("steps, survivors, plan", [
    # nobody holds state: every member restores the newest checkpoint
    ([-1, -1], [F, F], SyncPlan(from_checkpoint=True)),
    # everyone at one step: nothing to send
    ([7, 7, 7], [T, T, T], SyncPlan()),
    # a newcomer (-1) gets the survivors' state, from the lowest rank at the best step
    ([7, 7, -1], [T, T, F], SyncPlan(source=0)),
    # the step in flight: the survivor that applied it sends it
    ([7, 8, -1], [T, T, F], SyncPlan(source=1)),
    # issue 23.2: an admitted newcomer claims step 50,000: the survivors' state wins
    ([100, 100, 50_000], [T, T, F], SyncPlan(source=0)),
    ([100, 50_000], [T, F], SyncPlan(source=0)),
    # a member of the previous generation far ahead of its peers is not believed
    ([100, 100, 50_000], [T, T, T], SyncPlan(source=0, refused=(2,))),
    ([50_000, 100], [T, T], SyncPlan(source=1, refused=(0,))),
    # no survivor holds state (every worker of the last generation was lost): the holders decide
    ([-1, 40, 40], [T, F, F], SyncPlan(source=1)),
    ([-1, 40], [F, F], SyncPlan(source=1)),
])
def test_plan_state_sync(steps, survivors, plan):
    assert plan_state_sync(steps, survivors) == plan
