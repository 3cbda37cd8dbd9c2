"""The README and the user guide (docs/, built with MkDocs) stay true and whole.

* The guide builds with ``mkdocs build --strict``: a broken link, a missing anchor, a page left
  out of the navigation or a link to a repository file that does not exist fails the build.
* Every ``elasticctl`` command shown in the getting-started page and in the README is one this
  version accepts: ``up`` runs with ``--dry-run`` (it prints the torchrun command and exits: no
  etcd, no torchrun), every other command with ``--help``.
* The examples of the exit-code page end with the status the page gives them.
* The trainer's shape on the "Writing a trainer" page is the part below the marker of
  ``docs/examples/train.py``, a file tests/process/test_guide_example.py runs: the page cannot
  show code that no longer runs.
* The CLI reference (docs/reference/cli.md, written at build time by mkdocs-click and the hook's
  table of environment variables) names every flag of every command, and the variable of each.
* The operations page lists every event kind (the hook writes the table from ``EventKind``).
* The README stays a short user README: at most 300 lines, its links name files that exist, and
  the two commands CI runs from it (the one-line main command, the test command) are there.

No etcd and no training here: the commands run as subprocesses that parse, check and print.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = ROOT / "docs"

# Commands that start nothing with --dry-run; `join --dry-run` reads the job's spec from etcd, so
# join (like the commands that only read etcd) is checked with --help.
DRY_RUN = {"up"}


def code_blocks(markdown: str) -> list[str]:
    """The bodies of the fenced code blocks of a Markdown text, but those of a program's output
    (```text: what a command printed, not a command)."""
    return [body for language, body in re.findall(r"^```([^\n]*)\n(.*?)^```", markdown, flags=re.MULTILINE | re.DOTALL)
            if language.strip() != "text"]


def elasticctl_commands(markdown: str) -> list[list[str]]:
    """Every command line of the code blocks that runs elasticctl (after `&&` too), as argv
    without the program name; shell comments dropped."""
    commands = []
    for block in code_blocks(markdown):
        for line in block.replace("\\\n", " ").splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["elasticctl"]:
                    commands.append(words[1:])
    return commands


def checked_form(argv: list[str]) -> list[str]:
    """The form of a shown command that the test runs: it parses and checks everything it is
    given, and starts nothing."""
    if not argv or argv[0].startswith("-"):
        return argv  # `elasticctl --version`
    if argv[0] in DRY_RUN:
        # right after the command name: after the script, --dry-run would be the script's argument
        return argv if argv[1:2] == ["--dry-run"] else [argv[0], "--dry-run", *argv[1:]]
    return [*argv, "--help"]


def run_elasticctl(argv: list[str]) -> subprocess.CompletedProcess:
    # `python -m` puts the working directory (the repository) first on sys.path: this checkout's
    # elasticctl answers, whatever is installed; trainers/mlp.py is found where the docs say.
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICCTL_")}
    return subprocess.run([sys.executable, "-m", "elasticctl", *argv], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=120)


# -- the guide builds strictly -----------------------------------------------------------------


@pytest.fixture(scope="module")
def site(tmp_path_factory) -> Path:
    """The guide, built once with ``mkdocs build --strict`` (its HTML pages)."""
    for module in ("mkdocs", "mkdocs_click", "mkdocstrings"):
        if importlib.util.find_spec(module) is None:
            pytest.skip(f"{module} is not installed (pip install -e '.[test]' brings it)")
    site = tmp_path_factory.mktemp("guide") / "site"
    build = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--config-file",
                            str(ROOT / "mkdocs.yml"), "--site-dir", str(site)],
                           cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-4000:]
    assert "WARNING" not in build.stderr, build.stderr[-4000:]
    return site


def test_the_guide_builds_with_mkdocs_strict(site):
    for page in ("getting-started", "porting", "migrating", "hot-recovery", "spares-and-stragglers",
                 "operations", "troubleshooting", "glossary", "exit-codes", "compatibility", "protocol",
                 "security", "benchmarks", "architecture", "testing", "reference/options", "reference/cli",
                 "reference/api", "changelog", "how-hot-recovery-works", "two-hosts"):
        assert (site / page / "index.html").is_file(), page


def page_text(site: Path, page: str) -> str:
    """A built page's text, tags dropped and entities decoded."""
    import html

    return html.unescape(re.sub(r"<[^>]+>", "", (site / page / "index.html").read_text()))


def test_the_cli_reference_names_every_flag_of_every_command(site):
    import click

    from elasticctl.cli import cli

    text = page_text(site, "reference/cli")
    assert "Usage:" in text and "elasticctl up [OPTIONS]" in text, "mkdocs-click wrote no commands"
    missing = []
    for name, command in [("elasticctl", cli), *sorted(cli.commands.items())]:
        if name != "elasticctl":
            assert f"elasticctl {name} [OPTIONS]" in text, name
        for param in command.params:
            if isinstance(param, click.Option):
                missing += [f"{name} {flag}" for flag in (*param.opts, *param.secondary_opts)
                            if not re.search(rf"(?<![\w-]){re.escape(flag)}(?![\w-])", text)]
    assert missing == [], missing


def test_the_api_reference_documents_every_name_a_script_imports_from_its_docstring(site):
    """docs/reference/api.md is written by mkdocstrings from the code: each name of
    ``elasticctl.train`` has its entry, and the entry shows the docstring the code has now."""
    import elasticctl.train as elastic

    html_text = (site / "reference/api/index.html").read_text()
    text = " ".join(page_text(site, "reference/api").split())
    for name in elastic.__all__:
        module = elastic._EXPORTS[name]
        assert f'id="{module}.{name}"' in html_text, f"{module}.{name} has no entry in the API reference"
        first_line = (getattr(elastic, name).__doc__ or "").strip().splitlines()[0]
        assert first_line, f"{name} has no docstring to show"
        # the words of the first line, without the reST markup mkdocstrings renders differently
        words = " ".join(re.sub(r"[`*]|:\w+:", "", first_line).split())[:40]
        assert words in text, (name, words)


def test_the_cli_reference_names_the_variable_of_every_flag(site):
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = mkdocs_hooks.environment_variables()
    assert len(rows) >= 50 and ("ELASTICCTL_NODE_TTL", "--node-ttl", ["up"]) in rows, rows
    text = page_text(site, "reference/cli")
    assert [variable for variable, _, _ in rows if variable not in text] == []
    assert mkdocs_hooks.ENVIRONMENT_MARKER not in (site / "reference" / "cli" / "index.html").read_text()


def test_the_operations_page_lists_every_event_kind(site):
    from elasticctl.job.records import EventKind

    table = page_text(site, "operations").split("Every kind of event", 1)[1]
    assert [kind.value for kind in EventKind if not re.search(rf"(?<!\w){kind.value}\s", table)] == []


def test_the_variable_the_reference_names_is_the_one_click_reads():
    # `join --wait`'s variable follows its parameter's name, not the flag's: the page says so
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import mkdocs_hooks
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    rows = {(variable, flag): commands for variable, flag, commands in mkdocs_hooks.environment_variables()}
    assert rows[("ELASTICCTL_WAIT_SECONDS", "--wait")] == ["join"]
    env = {k: v for k, v in os.environ.items() if not k.startswith("ELASTICCTL_")}
    result = subprocess.run([sys.executable, "-m", "elasticctl", "join"], cwd=ROOT, capture_output=True,
                            text=True, timeout=120, env={**env, "ELASTICCTL_WAIT_SECONDS": "-1"})
    assert result.returncode == 2 and "'--wait'" in result.stderr, result.stderr


def test_every_page_of_docs_is_in_the_navigation():
    # (the strict build warns about one left out too; this says which without mkdocs installed)
    nav = (ROOT / "mkdocs.yml").read_text()
    pages = {str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md")}
    assert pages, "no pages"
    assert {p for p in pages if p not in nav} == set()


# -- the trainer the guide shows is a file that runs --------------------------------------------

EXAMPLE_MARKER = "# -- the page's code block "
FRAGMENT_MARKER = "<!-- fragment: "
# Each whole example a page shows: the page, and the file (under docs/examples/) whose text below
# its marker line is that code block, character for character.
EXAMPLE_FILES = {"writing-a-trainer.md": ["train.py", "train_sharded.py"], "porting.md": ["resumable_ddp.py"],
                 "lightning.md": ["lightning_trainer.py", "fabric_loop.py"],
                 "huggingface.md": ["huggingface_trainer.py", "accelerate_loop.py"]}


def python_blocks(markdown: str) -> list[tuple[str, bool]]:
    """Each ```python block of a page, and whether the line above it marks it as a fragment."""
    return [(body, bool(above)) for above, body in
            re.findall(rf"^({re.escape(FRAGMENT_MARKER)}[^\n]*\n)?```python\n(.*?)^```", markdown,
                       flags=re.MULTILINE | re.DOTALL)]


def shown_part(example: str) -> str:
    assert example.count(EXAMPLE_MARKER) == 1, "an example file must have one marker line"
    return example.split(EXAMPLE_MARKER, 1)[1].split("\n", 1)[1]


@pytest.mark.parametrize("page", sorted(p.name for p in DOCS.glob("*.md")))
def test_every_python_block_is_an_example_file_or_a_marked_fragment_that_parses(page):
    import ast

    text = (DOCS / page).read_text()
    files = EXAMPLE_FILES.get(page, [])
    shown = {name: shown_part((DOCS / "examples" / name).read_text()) for name in files}
    whole = []
    for body, fragment in python_blocks(text):
        ast.parse(body)  # a fragment too is Python
        if not fragment:
            matches = [name for name, part in shown.items() if part == body]
            assert matches, (f"{page} shows a whole script that is no file of docs/examples/ (or the file differs "
                             f"from the page: change both), or mark it '{FRAGMENT_MARKER}...':\n{body[:300]}")
            whole += matches
    assert sorted(whole) == sorted(files), f"{page} no longer shows {sorted(set(files) - set(whole))}"
    for name in files:
        assert f"(examples/{name})" in text, f"{page} links to the file it shows, examples/{name}"


def test_the_guide_shows_the_trainer_the_example_file_runs():
    page = (DOCS / "writing-a-trainer.md").read_text()
    first = code_blocks(page.split("## The shape of a trainer", 1)[1])[0]
    assert shown_part((DOCS / "examples" / "train.py").read_text()) == first, \
        "the page's first code block and docs/examples/train.py differ: change both"


# -- the commands shown are commands this version accepts --------------------------------------

# Getting started and its sequel across machines, Run on two hosts
GETTING_STARTED = elasticctl_commands((DOCS / "getting-started.md").read_text() + (DOCS / "two-hosts.md").read_text())
README_COMMANDS = elasticctl_commands(README.read_text())


def test_the_getting_started_pages_show_the_commands_of_a_two_node_job():
    names = [argv[0] for argv in GETTING_STARTED if argv]
    for needed in ("up", "join", "status", "events", "leave", "down", "etcd", "dashboard"):
        assert needed in names, needed
    assert len(GETTING_STARTED) >= 12, GETTING_STARTED


@pytest.mark.parametrize("argv", GETTING_STARTED + README_COMMANDS, ids=shlex.join)
def test_every_command_shown_is_accepted(argv):
    checked = checked_form(argv)
    result = run_elasticctl(checked)
    assert result.returncode == 0, (shlex.join(checked), result.stderr[-2000:])
    if checked[:2] == [argv[0], "--dry-run"]:
        assert "torch.distributed.run" in result.stdout, result.stdout  # it printed, and started nothing


def test_the_checked_form_starts_nothing():
    assert checked_form(["up", "--nnodes", "1:2", "t.py", "--steps", "5"]) == [
        "up", "--dry-run", "--nnodes", "1:2", "t.py", "--steps", "5"]
    assert checked_form(["join", "--etcd", "h:2379"]) == ["join", "--etcd", "h:2379", "--help"]
    assert checked_form(["--version"]) == ["--version"]


def test_every_command_of_the_cli_is_in_the_command_tables():
    from elasticctl.cli import cli

    for page in (README, DOCS / "commands.md"):
        text = page.read_text()
        missing = [name for name in cli.commands if f"| `{name}" not in text]
        assert missing == [], (page.name, missing)


# -- the exit-code page's examples -------------------------------------------------------------

EXAMPLE = re.compile(r"^\| `elasticctl ([^`]+)` \| (\d+) \|$", flags=re.MULTILINE)
EXIT_EXAMPLES = [(shlex.split(c), int(s)) for c, s in EXAMPLE.findall((DOCS / "exit-codes.md").read_text())]


def test_the_exit_code_page_has_examples_of_each_status():
    assert {status for _, status in EXIT_EXAMPLES} >= {0, 1, 2}


@pytest.mark.parametrize(("argv", "status"), EXIT_EXAMPLES, ids=lambda v: shlex.join(v) if isinstance(v, list) else str(v))
def test_the_exit_code_examples_end_as_the_page_says(argv, status):
    assert argv[0] != "up" or argv[1] == "--dry-run", "an example must start nothing"
    result = run_elasticctl(argv)
    assert result.returncode == status, (shlex.join(argv), result.stderr[-2000:])
    if status:
        assert result.stderr.strip().splitlines()[-1].startswith("elasticctl: error: "), result.stderr


# -- the README ----------------------------------------------------------------------------------


def test_the_readme_is_a_short_user_readme():
    assert len(README.read_text().splitlines()) <= 300


def test_the_readme_links_only_to_files_that_exist():
    text = README.read_text()
    links = re.findall(r"\]\(([^)\s]+)\)", text)
    assert len(links) >= 10, links  # the links are found: not vacuous
    missing = []
    for link in links:
        if re.match(r"^[a-z][a-z0-9+.-]*:", link) or link.startswith("#"):
            continue
        if not (ROOT / link.split("#", 1)[0]).exists():
            missing.append(link)
    assert missing == []


def test_the_readme_keeps_the_commands_ci_runs():
    text = README.read_text()
    # the one-line main command: install, then the main job on the embedded etcd
    main = [line for line in text.splitlines()
            if line.startswith("pip install torch==") and "&& pip install -e '.[train,etcd]' && elasticctl up " in line]
    assert len(main) == 1, main
    up = shlex.split(main[0].split("&&")[-1])
    assert up[:2] == ["elasticctl", "up"] and "--etcd-listen" in up and "trainers/mlp.py" in up
    # the test command, and what it runs
    assert "\nbash .ci/run\n" in text and (ROOT / ".ci" / "run").is_file()
    assert "bash scripts/test" in text and (ROOT / "scripts" / "test").is_file()


def test_the_dashboard_screenshot_shows_the_page_as_it_is():
    from support import screenshot

    stamp = screenshot.stamp_of(screenshot.SCREENSHOT.read_bytes())
    assert stamp == screenshot.page_fingerprint(), (
        f"{screenshot.SCREENSHOT.relative_to(screenshot.ROOT)} shows another version of the dashboard page "
        f"than elasticctl/dashboard/static: take it again with `{screenshot.REFRESH}` and commit it")


def test_the_screenshot_stamp_round_trips_and_replaces_an_older_one():
    from support import screenshot

    png = screenshot.SCREENSHOT.read_bytes()
    once = screenshot.stamp(png, "a" * 64)
    twice = screenshot.stamp(once, "b" * 64)
    assert screenshot.stamp_of(once) == "a" * 64 and screenshot.stamp_of(twice) == "b" * 64
    assert len(twice) == len(once) and twice.endswith(b"IEND\xaeB`\x82")
    assert "](dashboard.png)" in (screenshot.ROOT / "docs" / "operations.md").read_text()


def test_the_task_pages_speak_to_a_user_not_of_the_test_files():
    """The pages a user reads to get a job done name no test file: what the suite proves is said in
    words, and "How it is tested" (an internals page) maps it to the files."""
    import yaml

    nav = yaml.safe_load((ROOT / "mkdocs.yml").read_text(encoding="utf-8"))["nav"]
    task_pages = [page for entry in nav for title, page in entry.items()
                  if isinstance(page, str) and title not in ("Benchmarks", "Changelog")]
    assert "getting-started.md" in task_pages and "operations.md" in task_pages, task_pages
    named = [f"{page}: {match}" for page in task_pages
             for match in re.findall(r"tests/\w+/test_\w+\.py", (ROOT / "docs" / page).read_text(encoding="utf-8"))]
    assert named == [], named


# -- the figures the README quotes are BENCHMARKS.md's -----------------------------------------

def test_the_readmes_goodput_and_crash_figures_are_the_ones_benchmarks_md_reports():
    """One truth per figure: the README's "What it buys" paragraph quotes the goodput table (every
    system at 3 and at 5 nodes) and the range of the crash-at-every-shape medians of BENCHMARKS.md;
    a new benchmark run that moves them fails here until the README says the same."""
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    benchmarks = (ROOT / "BENCHMARKS.md").read_text(encoding="utf-8")
    systems = ("plain torchrun", "elasticctl restart", "elasticctl hot", "elasticctl hot + 1 spare")
    for nodes in (3, 5):
        goodput = []
        for system in systems:
            row = re.search(rf"^\| {nodes} nodes × 1 worker \| {re.escape(system)} \| ([0-9.]+) ", benchmarks, re.MULTILINE)
            assert row, f"BENCHMARKS.md has no goodput row for {system} at {nodes} nodes"
            goodput.append(row.group(1))
        assert re.search(r"\D" + r"\D+".join(map(re.escape, goodput)) + r"\D", readme), \
            f"the README does not quote the goodput at {nodes} nodes as BENCHMARKS.md has it: {goodput}"
    medians = [float(m) for m in re.findall(r"^\| \d+ × \d+ \| ([0-9.]+) \(", benchmarks, re.MULTILINE)]
    assert len(medians) >= 6, medians
    quoted = f"{min(medians):.2f}–{max(medians):.2f} s"
    assert quoted in readme, f"the README does not quote the crash medians as BENCHMARKS.md has them: {quoted}"
