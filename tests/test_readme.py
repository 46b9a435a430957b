"""The README runs (issue 27 §6): every command block, in the README's order, as a new user would type it; then the
command blocks of the ``docs/`` pages the README links to (issue 45 item 5: :data:`DOC_PAGES`, in that order).

One bash session (its variables, ``source`` and background jobs carry from block to block, as in a terminal) runs in
a copy of the repository's tracked files (the venv linked in), with its own ``HOME`` and ``PREFECT_HOME``, so nothing
of this checkout or this user is touched. Each command must exit 0. What the runner changes, and only that:

- port 4200 (a Prefect server) becomes a free port, so two runs on one machine never meet;
- ``<flow run id>`` becomes the id the previous ``prefect deployment run`` printed;
- a command already run earlier is not run again (the fine-tuning section repeats ``make demo``);
- a ``docs/`` page's blocks run after the README's, the pages in :data:`DOC_PAGES`' order; a page holds only commands
  that run here (those that need other machines stay in the README sections below);
- ``make test`` is not run (this test is part of it);
- the README's multi-machine section's commands name addresses of real machines: ``tests/test_cluster.py`` runs them on
  hosts made of network namespaces; the Slurm section's need a Slurm cluster: ``tests/test_slurm.py`` and
  ``tests/test_slurm_doctor.py`` run them on one made of network namespaces; the vision demo takes minutes:
  ``tests/test_vision_demo.py`` runs its commands on a short version, and the Shakespeare demo downloads its corpus and
  trains for minutes: ``tests/test_shakespeare_demo.py`` runs it on a generated corpus; this test checks that they
  still do.

A ``python`` block names its file in its first line (``# script.py``) and is written there; a ``yaml`` block that names
its file the same way (``# mine.yaml``) is written there and must validate as it is; any other ``yaml`` block is a
config fragment and must validate on top of ``configs/tiny.yaml``. At the end the registry is as the README says
(``champion`` on the demo's model, ``newest`` on the newest version) and the fine-tune learned to subtract (>= 80 %).
"""

from __future__ import annotations

import os
import queue
import re
import shlex
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
#: the pages whose command blocks run after the README's, in this order, in the same session (they need what
#: ``make demo`` left: its checkpoints, its MLflow store and registered model)
DOC_PAGES = ("docs/usage.md", "docs/checkpoints.md", "docs/permissions.md", "docs/data.md")
#: the README's size ceiling: one screen to a first result, the rest in docs/ (issue 45 item 5)
README_MAX_BYTES = 15 * 1024
#: the README's set-up commands, its first command block: exactly these
SETUP_COMMANDS = ["make demo", "make test"]
NOT_RUN = {"make test": "the test suite runs this test"}
#: README sections run by other tests: each test file, and the argument vectors it must still hold (whitespace ignored)
ELSEWHERE = {
    "Run on several machines": (
        ("tests/test_cluster.py", ('"server","start","--host"', '"node","start"', '"node","list"')),
    ),
    "Run on Slurm": (
        (
            "tests/test_slurm.py",
            ('"train","--config"', '"salloc","-N2"', '"squeue","-j",job', '"sacct","-j",job', '"scancel",job'),
        ),
        (
            "tests/test_slurm_doctor.py",
            ('"doctor","--config"', '"slurm","script"', '"sbatch","--test-only","job.sbatch"'),
        ),
        ("tests/test_slurm_cancel.py", ('"prefect","flow-run","cancel"',)),
    ),
    "Train on Shakespeare": (  # the real demo downloads the plays and takes minutes: the test runs it short
        ("tests/test_shakespeare_demo.py", ('"examples"/"shakespeare.sh"', '"--corpus",str(corpus)')),
    ),
    "Vision-language models": (  # the full demo takes minutes: the test runs it short
        (
            "tests/test_vision_demo.py",
            ('"data","shapes","data/shapes","--size"', '"plan","--config",demo', '"train","--config",demo')
            + ('"checkpoint","convert",step', '"--format","hf"', '"configs"/"vision-demo.yaml"'),
        ),
    ),
}
#: the block languages the README test runs (bash) or writes and checks (python, yaml); other blocks are output
RUN_LANGS = {"bash", "python", "yaml"}
EXPECTED_OUTPUT = {"kc launch --nproc-per-node 2 script.py": "tensor([2., 2., 2., 2.])"}
COMMAND_TIMEOUT_S = 900


@dataclass
class Block:
    lang: str
    text: str
    section: str
    line: int
    page: str = "README.md"

    @property
    def named_file(self) -> str | None:
        """The file a ``python`` or ``yaml`` block names in its first line (``# script.py``), else None."""
        first = self.text.splitlines()[0] if self.text else ""
        found = re.match(r"# ([\w./-]+\.(?:py|ya?ml))$", first)
        return found.group(1) if found else None


def readme_blocks(text: str) -> list[Block]:
    """The fenced blocks of a Markdown text with their language, the ``##`` section they are in and their line."""
    blocks, section, inside, lang, start, body = [], "", False, "", 0, []
    for number, line in enumerate(text.splitlines(), 1):
        if not inside and line.startswith("## "):
            section = line[3:].strip()
        elif line.startswith("```"):
            if inside:
                blocks.append(Block(lang, "\n".join(body), section, start))
                inside = False
            else:
                inside, lang, start, body = True, line[3:].strip(), number, []
        elif inside:
            body.append(line)
    assert not inside, f"README: the block opened at line {start} is never closed"
    return blocks


def page_blocks() -> list[Block]:
    """Every fenced block the README test runs, in order: the README's, then each of :data:`DOC_PAGES`'."""
    blocks = readme_blocks(README.read_text(encoding="utf-8"))
    for page in DOC_PAGES:
        for block in readme_blocks((ROOT / page).read_text(encoding="utf-8")):
            block.page = page
            blocks.append(block)
    return blocks


def commands(block: str) -> list[str]:
    """The commands of a bash block: continuation lines joined, blank and comment-only lines dropped."""
    out, pending = [], ""
    for line in block.splitlines():
        if pending:
            line = pending + " " + line.strip()
            pending = ""
        if line.rstrip().endswith("\\"):
            pending = line.rstrip()[:-1].rstrip()
            continue
        if line.strip() and not line.lstrip().startswith("#"):
            out.append(line.strip())
    assert not pending, f"a continued line never ends: {pending!r}"
    return out


def elsewhere_missing(section: str) -> list[str]:
    """What the tests that run README section ``section`` (:data:`ELSEWHERE`) no longer run: ``file: needle``."""
    missing = []
    for test_file, needles in ELSEWHERE[section]:
        text = re.sub(r"\s+", "", (ROOT / test_file).read_text(encoding="utf-8"))
        missing += [f"{test_file} no longer runs {n}" for n in needles if n not in text]
    return missing


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Shell:
    """One bash process fed one command at a time; a command's output ends at a marker line carrying its status."""

    def __init__(self, cwd: Path, env: dict[str, str]):
        self.proc = subprocess.Popen(
            ["bash", "--noprofile", "--norc"],
            cwd=cwd,
            env=env,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            bufsize=1,
            start_new_session=True,  # the session's background jobs (servers, workers) die with it
        )
        self.lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.proc.stdout:
            self.lines.put(line)
        self.lines.put("")  # bash ended

    def run(self, command: str, timeout_s: float) -> tuple[int, str]:
        """Run ``command`` in the session (stdin closed: nothing waits for a keyboard); its status and output."""
        marker = f"__kc_readme_{uuid.uuid4().hex}__"
        self.proc.stdin.write(f'__kc_cmd() {{\n{command}\n}}\n__kc_cmd < /dev/null 2>&1; echo "{marker} $?"\n')
        self.proc.stdin.flush()
        out, deadline = [], time.monotonic() + timeout_s
        while True:
            try:
                line = self.lines.get(timeout=max(0.1, deadline - time.monotonic()))
            except queue.Empty:
                raise TimeoutError(f"no end after {timeout_s:g} s; output so far:\n{''.join(out)[-4000:]}") from None
            if line == "":
                return -1, "".join(out) + "\n(the shell ended)"
            if line.startswith(marker):
                return int(line.split()[-1]), "".join(out)
            out.append(line)

    def close(self) -> None:
        """End the session and everything it started."""
        with _suppress():
            os.killpg(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            with _suppress():
                os.killpg(self.proc.pid, signal.SIGKILL)


class _suppress:  # noqa: N801 - reads as a context manager
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return exc[0] is not None and issubclass(exc[0], ProcessLookupError)


def _copy_repository(dest: Path) -> None:
    tracked = (
        subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode().split("\0")
    )
    for name in filter(None, tracked):
        src = ROOT / name
        if src.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dest / name)  # modification times kept: make sees the venv as up to date
    (dest / ".venv").symlink_to(ROOT / ".venv")
    # make's setup target reinstalls when pyproject.toml is newer than the venv's stamp: in the copy it must never be
    # (a reinstall through the link would point the shared venv's scripts and package at this temporary copy)
    stamp = ROOT / ".venv" / ".installed"
    if stamp.exists():
        t = min(stamp.stat().st_mtime - 1, (dest / "pyproject.toml").stat().st_mtime)
        os.utime(dest / "pyproject.toml", (t, t))


def test_readme_blocks_are_found_and_named():
    """The parser sees every kind of block the README and its pages have, and every python block names its file."""
    blocks = page_blocks()
    assert {b.lang for b in blocks} >= {"bash", "python", "yaml"}
    assert {b.page for b in blocks} == {"README.md", *DOC_PAGES}, "a page of DOC_PAGES has no block"
    for block in blocks:
        if block.lang == "python":
            assert block.named_file, f"{block.page} line {block.line}: name its file"
    assert commands("a \\\n  b  # x\n# c\n\nd &") == ["a b  # x", "d &"]
    assert shlex.join(shlex.split("make test   # the whole suite", comments=True)) in NOT_RUN
    assert Block("yaml", "# mine.yaml\ntask: {}", "", 1).named_file == "mine.yaml"
    assert Block("yaml", "task: {}  # mine.yaml", "", 1).named_file is None  # a fragment


def test_sections_run_elsewhere_are_in_the_readme_and_still_run_there():
    """Every :data:`ELSEWHERE` section is a README section with commands, and its tests still hold its commands."""
    sections = {b.section for b in readme_blocks(README.read_text(encoding="utf-8")) if b.lang == "bash"}
    for section in ELSEWHERE:
        assert section in sections, f"README has no section {section!r} with commands"
        assert not elsewhere_missing(section), elsewhere_missing(section)


def test_the_readme_is_one_screen_and_links_the_rest():
    """The README fits :data:`README_MAX_BYTES`, starts with exactly the two set-up commands, and links every
    ``docs/`` page; every page with a command block is one the README test runs (:data:`DOC_PAGES`)."""
    text = README.read_text(encoding="utf-8")
    assert len(text.encode("utf-8")) <= README_MAX_BYTES, f"README.md is {len(text.encode())} bytes"
    first = next(b for b in readme_blocks(text) if b.lang == "bash")
    setup = [shlex.join(shlex.split(c, comments=True)) for c in commands(first.text)]
    assert setup == SETUP_COMMANDS, f"README line {first.line}: the set-up commands are {setup}"
    pages = sorted(p.relative_to(ROOT).as_posix() for p in (ROOT / "docs").glob("*.md"))
    unlinked = [p for p in pages if f"]({p})" not in text]
    assert not unlinked, f"docs pages the README does not link: {unlinked}"
    with_commands = [p for p in pages if any(b.lang in RUN_LANGS for b in readme_blocks((ROOT / p).read_text()))]
    assert sorted(with_commands) == sorted(DOC_PAGES), "a docs page with commands the README test would not run"


@pytest.mark.slow
@pytest.mark.timeout(2400)
def test_every_readme_command_runs_in_order(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    _copy_repository(repo)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PREFECT_", "KC_", "MLFLOW_", "AWS_"))}
    env.update(
        HOME=str(tmp_path / "home"),
        PREFECT_HOME=str(tmp_path / "prefect-home"),
        PREFECT_SERVER_ANALYTICS_ENABLED="false",
        MLFLOW_ENABLE_TELEMETRY="false",
        DO_NOT_TRACK="1",
        OMP_NUM_THREADS="1",
    )
    port, done, flow_run_id = str(_free_port()), set(), None
    transcript = tmp_path / "transcript.log"  # every command and its output, as they run
    shell = Shell(repo, env)
    try:
        for block in page_blocks():
            where = f"{block.page} line {block.line} ({block.section})"
            if block.page == "README.md" and block.section in ELSEWHERE:
                assert not elsewhere_missing(block.section), f"{where}: {elsewhere_missing(block.section)}"
                continue
            if block.lang == "python":
                (repo / block.named_file).write_text(block.text + "\n", encoding="utf-8")
                continue
            if block.lang == "yaml":
                if block.named_file:  # a whole config the page asks to save under its name
                    config = repo / block.named_file
                    config.write_text(block.text + "\n", encoding="utf-8")
                else:
                    config = repo / f"{Path(block.page).stem.lower()}_line_{block.line}.yaml"
                    config.write_text(f"extends: configs/tiny.yaml\n{block.text}\n", encoding="utf-8")
                rc, out = shell.run(f".venv/bin/kc config validate {config.relative_to(repo)}", 120)
                assert rc == 0, f"{where}: the config does not validate:\n{out[-3000:]}"
                continue
            if block.lang != "bash":
                continue
            for command in commands(block.text):
                key = shlex.join(shlex.split(command, comments=True))  # the command without its comment
                if key in NOT_RUN or key in done:
                    continue
                line = command.replace("4200", port)
                if "prefect server start" in line:  # after its environment (telemetry off), if any
                    line = line.replace("prefect server start", f"prefect server start --port {port}", 1)
                if "<flow run id>" in line:
                    assert flow_run_id, f"{where}: no flow run id printed before {command!r}"
                    line = line.replace("<flow run id>", flow_run_id)
                with transcript.open("a", encoding="utf-8") as log:
                    log.write(f"$ {line}\n")
                started = time.monotonic()
                rc, out = shell.run(line, COMMAND_TIMEOUT_S)
                with transcript.open("a", encoding="utf-8") as log:
                    log.write(f"{out}[exit {rc} after {time.monotonic() - started:.0f} s]\n")
                assert rc == 0, f"{where}: `{command}` exited {rc}:\n{out[-6000:]}"
                for needle_command, needle in EXPECTED_OUTPUT.items():
                    if needle_command in command:
                        assert needle in out, f"{where}: `{command}` did not print {needle!r}:\n{out[-3000:]}"
                found = re.search(r"UUID: ([0-9a-f-]{36})", out)
                flow_run_id = found.group(1) if found else flow_run_id
                done.add(key)
    finally:
        shell.close()

    # the registry as the README promises it: champion on the demo's model, newest on the newest version
    from mlflow.tracking import MlflowClient

    client = MlflowClient(f"sqlite:///{repo / 'mlflow.db'}")
    versions = sorted(int(v.version) for v in client.search_model_versions("name='kc-tiny-demo'"))
    assert len(versions) >= 4, versions  # the demo, the 40- and 80-step runs, the deployment's 100-step run
    assert int(client.get_model_version_by_alias("kc-tiny-demo", "champion").version) == 1
    assert int(client.get_model_version_by_alias("kc-tiny-demo", "newest").version) == versions[-1]
    # the fine-tune section: from 0 % (the addition model does not subtract) to >= 80 % on 256 held-out problems
    tuned = client.get_run(client.get_model_version_by_alias("kc-finetune-demo", "newest").run_id)
    assert tuned.data.tags["kuangchao.base_model"] == "kc-tiny-demo v1"  # the champion: the demo's own model
    history = sorted((m.step, m.value) for m in client.get_metric_history(tuned.info.run_id, "eval_exact_match"))
    assert history[0] == (0, pytest.approx(0.0, abs=0.02)) and history[-1][1] >= 0.8, history
