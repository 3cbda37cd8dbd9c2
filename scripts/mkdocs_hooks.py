"""MkDocs hooks of the user guide (mkdocs.yml names this file).

* The repository's own top-level documents SECURITY.md and ARCHITECTURE.md stay where GitHub
  and their readers expect them, and are pages of the guide too.
* A link from a page to a file of the repository outside docs/ (``../trainers/mlp.py``,
  ``../BENCHMARKS.md``) becomes a link to that file's source at ``repo_url``,
  once the file is found to exist; a link to a file that does not exist is a warning, which
  ``mkdocs build --strict`` turns into a failure, like any other broken link.
* The table of event kinds (docs/operations.md, where the page holds ``EVENT_KINDS_MARKER``) is
  written from ``EventKind`` in elasticctl/job/records.py: each kind with the comment beside it.
* The CLI reference (docs/reference/cli.md) shows each command's ``--help`` through the
  ``mkdocs-click`` extension; its table of environment variables, one row per flag, is written
  here from the same click commands, where the page holds ``ENVIRONMENT_MARKER``.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path, PurePosixPath

from mkdocs.structure.files import File

log = logging.getLogger("mkdocs.hooks.elasticctl")

ROOT = Path(__file__).resolve().parents[1]
# page in the guide -> the repository's file it is made from
INCLUDED = {"security.md": "SECURITY.md", "architecture.md": "ARCHITECTURE.md", "changelog.md": "CHANGELOG.md",
            "benchmarks.md": "BENCHMARKS.md"}
# [text](target) and ![alt](target); a target with a scheme or a bare #anchor is left alone
LINK = re.compile(r"(!?\[[^\]]*\]\()([^)\s#]+)(#[^)\s]*)?(\))")
ENVIRONMENT_MARKER = "<!-- the environment variables of every flag, written by scripts/mkdocs_hooks.py -->"


def environment_variables() -> list[tuple[str, str, list[str]]]:
    """(variable, flag, commands) for every option of every ``elasticctl`` command: the variable
    click reads for it (an explicit ``envvar``, else ``auto_envvar_prefix`` and the option's name)."""
    import click

    from elasticctl.cli import cli

    rows: dict[tuple[str, str], list[str]] = {}
    root = click.Context(cli, info_name="elasticctl", **(cli.context_settings or {}))
    commands = [("elasticctl", cli, root)] + [
        (name, cli.commands[name], click.Context(cli.commands[name], info_name=name, parent=root,
                                                 **(cli.commands[name].context_settings or {})))
        for name in sorted(cli.commands)]
    for name, command, context in commands:
        for param in command.params:
            # --help and --version end the command before anything is read: no variable of theirs
            if not isinstance(param, click.Option) or param.name in ("help", "version"):
                continue
            variable = param.envvar or (f"{context.auto_envvar_prefix}_{param.name.upper()}"
                                        if context.auto_envvar_prefix and param.allow_from_autoenv else None)
            if isinstance(variable, (list, tuple)):
                variable = variable[0]
            if variable:
                flag = max(param.opts, key=len)
                rows.setdefault((variable, flag), []).append(name)
    return [(variable, flag, commands) for (variable, flag), commands in sorted(rows.items())]


EVENT_KINDS_MARKER = "<!-- the event kinds, written by scripts/mkdocs_hooks.py -->"


def event_kinds() -> list[tuple[str, str]]:
    """(kind, what it means) for every member of ``EventKind``, from the comment beside it."""
    import inspect

    from elasticctl.job.records import EventKind

    described = dict(re.findall(r'^\s+[A-Z_]+ = "(\w+)"\s+# (.+)$', inspect.getsource(EventKind), flags=re.MULTILINE))
    missing = [kind.value for kind in EventKind if kind.value not in described]
    if missing:
        raise ValueError(f"EventKind members without a comment to describe them: {missing}")
    return [(kind.value, described[kind.value].strip()) for kind in EventKind]


def event_kinds_table() -> str:
    lines = ["| kind | what happened |", "|---|---|"]
    lines += [f"| `{kind}` | {text.replace('|', chr(92) + '|')} |" for kind, text in event_kinds()]
    return "\n".join(lines)


def environment_table() -> str:
    lines = ["| variable | flag | commands |", "|---|---|---|"]
    for variable, flag, commands in environment_variables():
        lines.append(f"| `{variable}` | `{flag}` | {', '.join(f'`{c}`' for c in commands)} |")
    return "\n".join(lines)


def on_files(files, config):
    for page, source in INCLUDED.items():
        files.append(File.generated(config, page, abs_src_path=str(ROOT / source)))
    return files


def _repository_path(page_src: str, target: str) -> PurePosixPath | None:
    """The repository path a relative link names, if it leaves docs/ (None: a link inside the guide)."""
    if page_src in INCLUDED:
        # an included document's links are relative to the repository's root, where it lives
        base = PurePosixPath(INCLUDED[page_src]).parent
    else:
        base = PurePosixPath("docs") / PurePosixPath(page_src).parent
    parts: list[str] = []
    for part in (base / target).parts:
        if part == "..":
            if not parts:
                return PurePosixPath("..")  # above the repository: reported as missing
            parts.pop()
        elif part != ".":
            parts.append(part)
    path = PurePosixPath(*parts) if parts else PurePosixPath(".")
    if path.parts[:1] == ("docs",) and not (page_src in INCLUDED and target.endswith(".md")):
        return None
    return path


def on_page_markdown(markdown, page, config, files):
    repo = config["repo_url"].rstrip("/")
    src = page.file.src_uri
    if ENVIRONMENT_MARKER in markdown:
        markdown = markdown.replace(ENVIRONMENT_MARKER, environment_table())
    if EVENT_KINDS_MARKER in markdown:
        markdown = markdown.replace(EVENT_KINDS_MARKER, event_kinds_table())

    def rewrite(match: re.Match) -> str:
        opening, target, anchor, closing = match.groups()
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("/"):
            return match.group(0)
        path = _repository_path(src, target)
        if path is None:
            return match.group(0)  # mkdocs checks links inside the guide itself
        guide_page = {v: k for k, v in INCLUDED.items()}.get(str(path))
        if path.parts[:1] == ("docs",) or guide_page:
            # an included document linking a page of the guide, or another included document
            inside = guide_page or str(PurePosixPath(*path.parts[1:]))
            relative = "../" * str(PurePosixPath(src).parent).count("/") if "/" in src else ""
            return f"{opening}{relative}{inside}{anchor or ''}{closing}"
        if str(path) in ("..", ".") or not (ROOT / path).exists():
            log.warning("Doc file '%s' links '%s', which is not a file of the repository", src, target)
            return match.group(0)
        kind = "tree" if (ROOT / path).is_dir() else "blob"
        return f"{opening}{repo}/{kind}/main/{path}{anchor or ''}{closing}"

    return LINK.sub(rewrite, markdown)
