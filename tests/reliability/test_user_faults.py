"""Bad inputs and faults, run as a user would: `python -m runtime.launch` on real files (YAML, JSONL,
tokenizer folders, DCP checkpoints), real signals to real processes.

Most cases run runtime.launch's main in this process (the `cli` fixture): the same argv parsing, config
check, preflight, training and failure report (runtime.guard.failure_report.guarded_main) as the command, its
closing os._exit turned into a return, so a case costs what it checks and not a Python start with torch.
A process of its own is kept where a process is the point (signals, a concurrent run on the same folder, a
torn save by kill -9: children forked from this process, tests.conftest.Forked; a killed rank and a resume
on two ranks: torchrun) and for one error of each class through the real command: config here; checkpoint
and torchrun's printed-once in tests/unit/test_launch_errors.py (interrupt and internal in forked
children there); a frozen rank in tests/dist/test_watchdog.py.

Every case ends in one of two outcomes, and the test asserts which:
- a clear error: exit code != 0, no traceback, one `error:` line (from rank 0 only) that matches
  what the case expects to be named;
- correct training: exit code 0 and the expected steps in metrics.jsonl.
No case may hang (each has a timeout) or lose a checkpoint that existed before it.
docs/reliability.md tabulates the cases.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from functools import partial
from pathlib import Path

import pytest
import yaml

from tests.conftest import Ahead, Finished, forked_launch, lane_environ, small_chat_data

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "examples" / "tiny"
EXAMPLE = ROOT / "examples" / "tiny-qwen3-moe.yaml"
TIMEOUT_S = 240
# Steps of a run that a test stops itself (signal, kill): more than any machine trains before it does.
LONG_RUN = 10**6


def base_config(out: Path) -> dict:
    """The tiny example, made small and fast (300 of its chat records), with absolute paths."""
    cfg = yaml.safe_load(EXAMPLE.read_text())
    cfg["data"].update(path=small_chat_data(), tokenizer=str(TINY / "tokenizer"), seq_len=64)
    cfg["optim"]["warmup_steps"] = 1
    cfg["train"].update(max_steps=2, micro_batch_size=2, output_dir=str(out))
    cfg["checkpoint"] = {"every_n_steps": 0, "keep_last": 2}
    cfg["logging"] = {"progress_bar": False}
    return cfg


def write_config(tmp: Path, cfg: dict | str, name: str = "cfg.yaml") -> Path:
    path = tmp / name
    path.write_text(cfg if isinstance(cfg, str) else yaml.safe_dump(cfg))
    return path


CHILD_ENV = {"OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def launch(args: list[str], nproc: int = 1, timeout: float = TIMEOUT_S):
    """The command run to its end: one process, `python -m runtime.launch` itself; several, torchrun's agent
    and its workers. .returncode and .stderr."""
    if nproc == 1:
        return subprocess.run([sys.executable, "-m", "runtime.launch", *map(str, args)], cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout, env={**lane_environ(), **CHILD_ENV},
                              check=False)
    proc, stderr = _torchrun(args, nproc)
    try:
        proc.wait(timeout)
    finally:
        _end(proc)
    return Finished(proc.returncode, stderr.read_text())


def _torchrun(args: list[str], nproc: int) -> tuple[subprocess.Popen, Path]:
    """torchrun's agent and its workers, fresh processes in a process group of their own (the torchrun cases are
    Ahead jobs, whose thread may not fork this process): (the agent, the file of its stderr)."""
    stderr = Path(str(args[0])).parent / f"torchrun-{time.monotonic_ns()}.stderr"
    with stderr.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", "--standalone",
                                 f"--nproc_per_node={nproc}", "-m", "runtime.launch", *map(str, args)],
                                cwd=ROOT, env={**lane_environ(), **CHILD_ENV}, stdout=subprocess.DEVNULL, stderr=err,
                                start_new_session=True)
    return proc, stderr


def _end(proc: subprocess.Popen) -> None:
    """Whatever a failed case left of torchrun: its process group, the agent and its workers."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def start(args: list[str]):
    """The command in the background, in a process group of its own, in a child forked from this process
    (tests.conftest.Forked: no Python start, the same signals and exit codes; the command's own start is
    test_config_error_through_the_command's): runtime.launch's main."""
    return forked_launch(args, Path(str(args[0])).parent / f"stderr-{time.monotonic_ns()}.txt", new_session=True)


_AGENT_LOG = re.compile(r"^[IWE]\d{4} \d\d:\d\d:\d\d\.\d+ +\d+ .*torch/distributed/")


def ranks_stderr(stderr: str) -> str:
    """What our ranks printed: torchrun's own agent adds its log lines and, when a worker fails, a
    traceback of its ChildFailedError (torchrun's report, not ours), which is cut off here."""
    lines = [line for line in stderr.splitlines() if not _AGENT_LOG.match(line)]
    text = "\n".join(lines)
    agent = re.search(r"Traceback \(most recent call last\):\n(?:.*\n)*?.*torch/distributed/run\.py", text)
    return text[:agent.start()] if agent else text


def assert_clear_error(proc, pattern: str) -> str:
    """Exit != 0, no traceback, exactly one `error:` line, matching `pattern` (searched in the error
    message, which may continue on indented lines)."""
    err = ranks_stderr(proc.stderr)
    assert proc.returncode != 0, err[-3000:]
    assert "Traceback" not in err, err[-3000:]
    starts = [i for i, line in enumerate(err.splitlines()) if line.startswith("error:")]
    assert len(starts) == 1, err[-3000:]
    message = "\n".join(err.splitlines()[starts[0]:])
    assert re.search(pattern, message, re.DOTALL), message
    return message


def steps_logged(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


def assert_trains(proc, out: Path, steps: list[int]) -> None:
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert steps_logged(out) == steps


# ---------------------------------------------------------------------------------------------
# Config: each case edits the tiny config (or passes flags) and names what the error must name.

def _set(cfg, dotted, value):
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node.setdefault(key, {})
    node[leaf] = value


def _drop(cfg, dotted):
    *parents, leaf = dotted.split(".")
    node = cfg
    for key in parents:
        node = node[key]
    del node[leaf]


def _edit(*pairs):
    def apply(cfg, tmp):
        for dotted, value in pairs:
            _set(cfg, dotted, value) if value is not _DROP else _drop(cfg, dotted)
    return apply


_DROP = object()


def _model_path_without_weights(cfg, tmp):
    (tmp / "hf").mkdir()
    hf = dict(cfg["model"]["config"], architectures=["Qwen3MoeForCausalLM"])
    (tmp / "hf" / "config.json").write_text(json.dumps(hf))
    cfg["model"] = {"path": str(tmp / "hf")}


# Cases whose message tests/unit/test_config.py asserts (config_from_dict, load_config, preflight) are
# checked there, not again here: unknown section or key, wrong type, negative lr, warmup >= max_steps,
# model.path and model.config, random init without tokenizer, cp pieces, fp4 full fine-tune, deepep,
# expert_backend and lora target typos, dp_shard 0, inductor options, the model.config typos, top-k,
# heads vs kv heads, vocab < tokenizer, unknown model_type, empty tokenizer folder, model.path without
# config.json, and (tests/unit/test_launch_errors.py) data.path and data.tokenizer missing. What this
# file adds for every class of them, through the cases below: one line, no traceback, no checkpoint.
CONFIG_CASES = {
    # YAML schema
    "seq_len too small": (_edit(("data.seq_len", 4)), r"data.seq_len"),
    "no model source": (_edit(("model.config", _DROP)), r"exactly one of model.path"),
    "eval every n steps without eval data": (_edit(("train.eval_every_n_steps", 5)), r"data.eval_fraction"),
    "merged export without lora": (_edit(("checkpoint.export_merged", True)), r"export_merged.*lora.enabled"),
    "wandb without a project": (_edit(("logging.wandb", {"mode": "offline"})), r"logging.wandb.project"),
    "data.format unknown": (_edit(("data.format", "csv")), r"data.format"),
    "grad_accum_steps 0": (_edit(("train.grad_accum_steps", 0)), r"train.grad_accum_steps"),
    "keep_last 0": (_edit(("checkpoint.keep_last", 0)), r"checkpoint.keep_last"),
    "dtype float16": (_edit(("model.dtype", "float16")), r"model.dtype"),
    "nan_policy typo": (_edit(("train.nan_policy", "ignore")), r"train.nan_policy"),
    "betas of length 3": (_edit(("optim.betas", [0.9, 0.95, 0.99])), r"optim.betas"),
    "timeout too small": (_edit(("parallelism.collective_timeout_s", 0)), r"collective_timeout_s"),
    # model.config: validated like the rest of the YAML
    "model.config missing hidden_size": (_edit(("model.config.hidden_size", _DROP)), r"hidden_size"),
    "model.path missing": (_edit(("model.config", _DROP), ("model.path", "/nonexistent/model")),
                           r"/nonexistent/model"),
    "model.path without weights": (_model_path_without_weights, r"safetensors"),
}


@pytest.mark.parametrize("name", sorted(CONFIG_CASES))
def test_config_error_is_one_clear_line(name, tmp_path, cli):
    edit, pattern = CONFIG_CASES[name]
    cfg = base_config(tmp_path / "run")
    edit(cfg, tmp_path)
    assert_clear_error(cli([write_config(tmp_path, cfg)]), pattern)
    assert not list((tmp_path / "run").glob("checkpoints/step_*"))


def _config_error_through_the_command(tmp: Path):
    cfg = base_config(tmp / "run")
    _set(cfg, "optim.learning_rate", 1e-3)
    return launch([write_config(tmp, cfg)]), tmp / "run"


CONFIG_ERROR_THROUGH_THE_COMMAND = Ahead(_config_error_through_the_command)  # CI time: beside in-process tests


@pytest.mark.ahead(CONFIG_ERROR_THROUGH_THE_COMMAND)
def test_config_error_through_the_command():
    """The config error class as a user meets it: `python -m runtime.launch` in its own process."""
    done, out = CONFIG_ERROR_THROUGH_THE_COMMAND.result()
    assert_clear_error(done, r"optim.learning_rate: unknown key")
    assert not out.exists()


CLI_CASES = {
    "config file missing": (lambda tmp: ["nonexistent.yaml"], r"nonexistent.yaml does not exist"),
    "YAML syntax error": (lambda tmp: [write_config(tmp, "model:\n  config: {a: 1\ndata: x\n")],
                          r"cfg.yaml:\d+: YAML syntax error"),
    "top level is a list": (lambda tmp: [write_config(tmp, "- a\n- b\n")], r"top level must be a mapping"),
    "--set without =": (lambda tmp: [write_config(tmp, base_config(tmp / "run")), "--set", "optim.lr"],
                        r"--set 'optim.lr': expected KEY=VALUE"),
    "--set bad YAML": (lambda tmp: [write_config(tmp, base_config(tmp / "run")), "--set", "optim.lr=[1"],
                       r"not valid YAML"),
    "--set unknown key": (lambda tmp: [write_config(tmp, base_config(tmp / "run")), "--set", "optim.lrr=1"],
                          r"optim.lrr: unknown key"),
    "--max-steps 0": (lambda tmp: [write_config(tmp, base_config(tmp / "run")), "--max-steps", "0"],
                      r"train.max_steps"),
}


@pytest.mark.parametrize("name", sorted(CLI_CASES))
def test_cli_error_is_one_clear_line(name, tmp_path, cli):
    args, pattern = CLI_CASES[name]
    assert_clear_error(cli(args(tmp_path)), pattern)


# ---------------------------------------------------------------------------------------------
# Data

def _jsonl(tmp: Path, lines: list[str], name: str = "data.jsonl") -> Path:
    path = tmp / name
    path.write_text("\n".join(lines) + "\n")
    return path


def _chat(user: str, answer: str) -> str:
    return json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": answer}]})


GOOD = [_chat(f"What is {i} plus {i}?", f"It is {2 * i}.") for i in range(60)]
LONG = _chat("Repeat: " + " ".join(["blue sky"] * 80), "ok")

DATA_ERRORS = {
    "unknown extension": (lambda tmp: _jsonl(tmp, GOOD, "data.txt"), r"data.txt.*data.format"),
    "empty file": (lambda tmp: _jsonl(tmp, []), r"data.jsonl"),
    "invalid JSON line": (lambda tmp: _jsonl(tmp, GOOD[:2] + ["{not json"] + GOOD[2:]), r"data.jsonl:3"),
    "record without text or messages": (lambda tmp: _jsonl(tmp, GOOD[:4] + ['{"prompt": "x"}']), r"data.jsonl:5"),
    "messages not a list": (lambda tmp: _jsonl(tmp, GOOD[:1] + ['{"messages": "hi"}']), r"data.jsonl:2"),
    "unknown role": (lambda tmp: _jsonl(tmp, GOOD[:1] + [json.dumps(
        {"messages": [{"role": "robot", "content": "x"}, {"role": "assistant", "content": "y"}]})]),
        r"data.jsonl:2"),
    "every chat longer than seq_len": (lambda tmp: _jsonl(tmp, [LONG] * 10), r"seq_len"),
    "folder mixing jsonl and parquet": (lambda tmp: _mixed_folder(tmp), r"mixes .jsonl and .parquet"),
}


def _mixed_folder(tmp: Path) -> Path:
    folder = tmp / "mixed"
    folder.mkdir()
    _jsonl(folder, GOOD, "a.jsonl")
    (folder / "b.parquet").write_bytes(b"PAR1")
    return folder


@pytest.mark.parametrize("name", sorted(DATA_ERRORS))
def test_bad_data_is_one_clear_line(name, tmp_path, cli):
    make, pattern = DATA_ERRORS[name]
    cfg = base_config(tmp_path / "run")
    cfg["data"]["path"] = str(make(tmp_path))
    assert_clear_error(cli([write_config(tmp_path, cfg)]), pattern)


def test_a_few_overlong_chats_train_and_are_counted(tmp_path, cli):
    cfg = base_config(tmp_path / "run")
    cfg["data"]["path"] = str(_jsonl(tmp_path, GOOD[:20] + [LONG] * 3 + GOOD[20:]))
    cfg["train"].update(micro_batch_size=1, max_steps=12)
    proc = cli([write_config(tmp_path, cfg)])
    assert_trains(proc, tmp_path / "run", list(range(1, 13)))
    assert re.search(r"3 of 63 chat records .*dropped", proc.stderr), proc.stderr[-2000:]


def test_blank_lines_and_unicode_train(tmp_path, cli):
    cfg = base_config(tmp_path / "run")
    lines = GOOD[:30] + ["", "   "] + [_chat("Was ist 2 plus 2? 🙂", "Vier — 4.")] + GOOD[30:]
    cfg["data"]["path"] = str(_jsonl(tmp_path, lines))
    assert_trains(cli([write_config(tmp_path, cfg)]), tmp_path / "run", [1, 2])


def test_text_data_trains(tmp_path, cli):
    cfg = base_config(tmp_path / "run")
    cfg["data"].update(path=str(TINY / "data" / "text.jsonl"), kind="text")
    assert_trains(cli([write_config(tmp_path, cfg)]), tmp_path / "run", [1, 2])


# ---------------------------------------------------------------------------------------------
# Run folder, checkpoints, resume

def _train(run, tmp: Path, out: Path, steps: int, *extra, every: int = 2, **edits):
    """run(args) (the `cli` fixture, or a subprocess) on the base config training `steps` into `out`."""
    cfg = base_config(out)
    cfg["train"]["max_steps"] = steps
    cfg["checkpoint"]["every_n_steps"] = every
    for dotted, value in edits.items():
        _set(cfg, dotted.replace("__", "."), value)
    return run([write_config(tmp, cfg, f"cfg-{time.monotonic_ns()}.yaml"), *extra])


def _finished_checkpoints(out: Path) -> list[Path]:
    """Finished checkpoint folders (pruning removes older ones, so a test waits for any, not a step)."""
    return sorted((out / "checkpoints").glob("step_*"))


def _checkpoints(out: Path) -> list[str]:
    return sorted(p.name for p in (out / "checkpoints").iterdir())


def test_fresh_run_in_a_used_dir_refuses_and_keeps_its_checkpoints(tmp_path, cli):
    out = tmp_path / "run"
    assert _train(cli, tmp_path, out, 4).returncode == 0
    before = _checkpoints(out)
    assert_clear_error(_train(cli, tmp_path, out, 4), rf"{out} already holds checkpoints.*--resume.*train.output_dir")
    assert _checkpoints(out) == before
    proc = _train(cli, tmp_path, out, 6, "--resume")  # the same run goes on
    assert_trains(proc, out, [1, 2, 3, 4, 5, 6])


def test_a_concurrent_run_on_the_same_dir_fails_at_start(tmp_path, cli):
    out = tmp_path / "run"
    cfg = base_config(out)
    cfg["train"]["max_steps"] = LONG_RUN
    first = start([write_config(tmp_path, cfg, "a.yaml")])
    try:
        _wait_for(lambda: (out / "metrics.jsonl").is_file(), first)
        second = cli([write_config(tmp_path, cfg, "b.yaml")])
        assert_clear_error(second, rf"output dir {out} is in use by another run \(pid {first.pid}")
        assert first.poll() is None  # the first run is untouched
    finally:
        first.kill()
        first.communicate()


def test_resume_on_an_empty_dir_starts_at_step_1(tmp_path, cli):
    out = tmp_path / "run"
    proc = _train(cli, tmp_path, out, 2, "--resume")
    assert_trains(proc, out, [1, 2])
    assert "holds no checkpoint: starting from step 0" in proc.stderr


@pytest.mark.slow
def test_kill_9_mid_run_then_resume_continues(tmp_path, cli):
    out = tmp_path / "run"
    cfg = base_config(out)
    cfg["train"]["max_steps"] = LONG_RUN
    cfg["checkpoint"]["every_n_steps"] = 2
    path = write_config(tmp_path, cfg)
    proc = start([path])
    _wait_for(lambda: len(_finished_checkpoints(out)) >= 2, proc)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.communicate()
    saved = _checkpoints(out)
    newest = int(saved[-1].removeprefix("step_"))
    # A torn save from another crash is left as a .tmp folder: it must never be loaded.
    (out / "checkpoints" / f".tmp-step_{newest + 2:08d}").mkdir(exist_ok=True)
    resumed = cli([path, "--resume", "--max-steps", str(newest + 2)])
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"resumed from {out / 'checkpoints' / saved[-1]}" in resumed.stderr
    assert steps_logged(out) == list(range(1, newest + 3))


def test_missing_rank_state_is_one_clear_line(tmp_path, cli):
    out = tmp_path / "run"
    assert _train(cli, tmp_path, out, 2).returncode == 0
    (out / "checkpoints" / "step_00000002" / "extra_rank0.pt").unlink()
    assert_clear_error(_train(cli, tmp_path, out, 4, "--resume"), r"extra_rank0.pt")


def test_resume_into_another_model_is_one_clear_line(tmp_path, cli):
    out = tmp_path / "run"
    assert _train(cli, tmp_path, out, 2).returncode == 0
    assert_clear_error(_train(cli, tmp_path, out, 4, "--resume", lora__enabled=True), r"different model")


def _resume_on_another_world_size(tmp: Path):
    """Two steps on one process, then a resume to step 4 on two ranks with ep 2: (both runs, the run folder)."""
    out = tmp / "run"
    first = _train(launch, tmp, out, 2)
    if first.returncode != 0:
        return first, None, out
    return first, _train(partial(launch, nproc=2), tmp, out, 4, "--resume", "--ep", "2"), out


RESUME_ON_ANOTHER_WORLD_SIZE = Ahead(_resume_on_another_world_size)  # CI time: beside the in-process tests


@pytest.mark.slow
@pytest.mark.ahead(RESUME_ON_ANOTHER_WORLD_SIZE)
def test_resume_on_another_world_size_and_ep_reshards():
    first, resumed, out = RESUME_ON_ANOTHER_WORLD_SIZE.result()
    assert first.returncode == 0, first.stderr[-3000:]
    assert_trains(resumed, out, [1, 2, 3, 4])


def test_output_dir_is_a_file_fails_before_training(tmp_path, cli):
    (tmp_path / "run").write_text("x")
    assert_clear_error(cli([write_config(tmp_path, base_config(tmp_path / "run"))]), rf"{tmp_path}/run")


# ---------------------------------------------------------------------------------------------
# Divergence

def test_divergence_stops_with_the_last_good_checkpoint(tmp_path, cli):
    out = tmp_path / "run"
    proc = _train(cli, tmp_path, out, 30, optim__lr=1e30, optim__grad_clip=0.0, optim__warmup_steps=0)
    message = assert_clear_error(proc, r"at step \d+: the update was not applied; last good checkpoint")
    records = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert all(r["loss"] is not None for r in records)  # no poisoned step was logged as trained
    named = re.search(r"last good checkpoint: (.+?); ", message)[1]
    assert named.startswith("none") or Path(named).is_dir()


def test_divergence_with_skip_policy_stops_after_n_in_a_row(tmp_path, cli):
    out = tmp_path / "run"
    proc = _train(cli, tmp_path, out, 30, optim__lr=1e30, optim__grad_clip=0.0, optim__warmup_steps=0,
                  train__nan_policy="skip", train__max_nan_skips=2)
    assert_clear_error(proc, r"2 non-finite steps in a row \(train.max_nan_skips=2\)")


# ---------------------------------------------------------------------------------------------
# Signals and ranks

def _wait_for(condition, proc, timeout: float = TIMEOUT_S) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            raise AssertionError(f"the run ended early: {proc.communicate()[1][-3000:]}")
        assert time.monotonic() < deadline, "the run made no progress"
        time.sleep(0.2)


# SIGINT: tests/unit/test_launch_errors.py checks its hint word for word and runs it
def test_sigterm_says_where_to_resume(tmp_path):
    sig = signal.SIGTERM
    out = tmp_path / "run"
    cfg = base_config(out)
    cfg["train"]["max_steps"] = LONG_RUN
    cfg["checkpoint"]["every_n_steps"] = 2
    proc = start([write_config(tmp_path, cfg)])
    _wait_for(lambda: _finished_checkpoints(out), proc)
    proc.send_signal(sig)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode != 0
    assert "Traceback" not in err, err[-3000:]
    assert re.search(r"interrupted at step \d+.*step_\d{8}.*--resume", err, re.DOTALL), err[-3000:]


def _a_killed_rank(tmp: Path) -> tuple[list[str], int]:
    """Two ranks under torchrun, one killed once the run has logged a step: (torchrun's workers then, its exit
    code)."""
    out = tmp / "run"
    cfg = base_config(out)
    cfg["train"]["max_steps"] = LONG_RUN
    proc, stderr = _torchrun([write_config(tmp, cfg)], 2)
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not (out / "metrics.jsonl").is_file():
            if proc.poll() is not None:
                raise AssertionError(f"the run ended early: {stderr.read_text()[-3000:]}")
            assert time.monotonic() < deadline, "the run made no progress"
            time.sleep(0.2)
        workers = subprocess.run(["pgrep", "-P", str(proc.pid)], capture_output=True, text=True,
                                 check=False).stdout.split()
        if len(workers) == 2:
            os.kill(int(workers[-1]), signal.SIGKILL)
            proc.wait(timeout=120)  # no hang: torchrun ends the surviving rank
    finally:
        _end(proc)
    return workers, proc.returncode


A_KILLED_RANK = Ahead(_a_killed_rank)  # CI time: beside the in-process tests


@pytest.mark.slow
@pytest.mark.ahead(A_KILLED_RANK)
def test_a_killed_rank_ends_the_whole_run():
    workers, returncode = A_KILLED_RANK.result()
    assert len(workers) == 2
    assert returncode != 0
