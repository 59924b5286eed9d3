"""Shared fixtures: tiny HF checkpoints written by transformers' own save_pretrained; every test runs in a
temporary folder, not in the checkout."""

from __future__ import annotations

import gc
import logging
import os
import signal
import sys
import tempfile
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

os.environ.setdefault("HF_HUB_OFFLINE", "1")
# Without a GPU, Triton kernels run in the interpreter. It is chosen when triton is first imported,
# so it is set here, before any test module imports a kernel.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
if os.environ.get("TRITON_INTERPRET") == "1":  # tests/triton_interpreter.py: the same kernels, less time
    from tests.triton_interpreter import install

    install()
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# One intra-op thread on a CPU-only machine, here and (by the environment) in the tests' subprocesses, as
# run_dist's ranks and torchrun's workers have: the tests' tiny ops gain nothing from a second thread, and
# some lose much to it (index_add of a [64, 64] block: ~1.6 ms with 2 OpenMP threads, ~8 us with one).
if not torch.cuda.is_available() and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

TINY_MOE = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 3, "num_attention_heads": 4,
            "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
            "num_experts": 8, "num_experts_per_tok": 2, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
            "norm_topk_prob": True}
TINY_HYBRID = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 4, "num_attention_heads": 4,
               "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "moe_intermediate_size": 32,
               "shared_expert_intermediate_size": 48, "num_experts": 8, "num_experts_per_tok": 2,
               "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
               "linear_value_head_dim": 16, "linear_conv_kernel_dim": 4, "max_position_embeddings": 256,
               "rms_norm_eps": 1e-6}
TINY_DENSE = {"vocab_size": 320, "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "intermediate_size": 96, "max_position_embeddings": 256}


def label_loss_sum(logits_BSV: torch.Tensor, labels_BS: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy over label tokens of full logits (labels are pre-shifted targets)."""
    from runtime.loss import IGNORE_INDEX  # here: conftest sets TRITON_INTERPRET before any runtime import

    return F.cross_entropy(logits_BSV.flatten(0, 1).float(), labels_BS.flatten(), ignore_index=IGNORE_INDEX,
                           reduction="sum")


TINY_CHAT = Path(__file__).resolve().parents[1] / "examples" / "tiny" / "data" / "train.jsonl"


def small_chat_data(records: int = 300) -> str:
    """The first `records` of the tiny example's 3,000 chat records, as a file in the temp folder: rows
    enough for a test's few steps (a loader cycles epochs), where tokenizing all of them (a chat template
    per record) costs about a second of CPU in every process that builds a loader. Named by its content
    and written atomically, so ranks and subprocesses can ask for it at the same time."""
    text = "".join(TINY_CHAT.read_text().splitlines(keepends=True)[:records])
    path = Path(tempfile.gettempdir()) / f"tiny-chat-{records}-{zlib.crc32(text.encode()):08x}.jsonl"
    if not path.is_file():
        part = path.with_name(f"{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")  # Ahead's thread too
        part.write_text(text)
        os.replace(part, path)
    return str(path)


def nan_slot_buffers(monkeypatch, guard_rows: int = 0) -> list:
    """Makes every expert-sorted buffer (moe.kernels.routing.SlotOrder.new_rows) all NaN, with `guard_rows` NaN rows
    past its capacity; returns the (capacity, whole buffer) pairs made. A kernel that read a row it never wrote
    shows up as NaN in its results, one that wrote past the capacity as a guard row no longer NaN."""
    from moe.kernels.routing import SlotOrder

    made = []

    def new_rows(self, like, cols):
        whole = like.new_full((self.capacity + guard_rows, cols), float("nan"))
        made.append((self.capacity, whole))
        return whole[:self.capacity]
    monkeypatch.setattr(SlotOrder, "new_rows", new_rows)
    return made


def sentinel_routing(M: int, k: int, hidden: int, experts: int = 4):
    """(x [M, hidden], ids [M, k], routing weights [M, k]) of an expert layer, x and the weights requiring grad:
    one slot belongs to another EP rank (-1) and the last expert receives no token."""
    x = torch.randn(M, hidden, requires_grad=True)
    ids = torch.randint(0, experts, (M, k))
    ids[0, 1] = -1
    ids[ids == experts - 1] = -1
    return x, ids, torch.rand(M, k, requires_grad=True)


def perturb_(model: torch.nn.Module, seed: int = 0) -> None:
    """Random values everywhere (norms and routers too), so parity does not pass by symmetry."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in sorted(model.named_parameters()):
            p.copy_(torch.randn(p.shape, generator=g) * (0.1 if p.dim() > 1 else 0.2) + (1.0 if p.dim() == 1 else 0))


def write_hf_checkpoint(path, kind: str = "moe", seed: int = 0, **overrides):
    """Writes a randomly perturbed transformers model with save_pretrained; returns the HF model."""
    torch.manual_seed(seed)
    model = _build_hf_model(kind, overrides)
    perturb_(model, seed)
    model.save_pretrained(path)
    return model.eval()


@torch.no_grad()
def packed_vs_alone(model, lengths: tuple[int, ...], seed: int = 3):
    """Documents of `lengths` packed in one row (positions restarting per document) and run alone:
    [(document tokens, its logits from the packed row, its logits alone)]."""
    g = torch.Generator().manual_seed(seed)
    docs = [torch.randint(0, 320, (n,), generator=g) for n in lengths]
    packed = model(torch.cat(docs).unsqueeze(0), position_ids=torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0))
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [(d, packed[:, s:s + len(d)], model(d.unsqueeze(0))) for d, s in zip(docs, starts)]


def _build_hf_model(kind: str, overrides: dict):
    import transformers as tf

    if kind == "moe":
        return tf.Qwen3MoeForCausalLM(tf.Qwen3MoeConfig(**{**TINY_MOE, **overrides}))
    if kind == "dense":
        return tf.Qwen3ForCausalLM(tf.Qwen3Config(**{**TINY_DENSE, **overrides}))
    if kind == "qwen3_next":
        return tf.Qwen3NextForCausalLM(tf.Qwen3NextConfig(**{**TINY_HYBRID, **overrides}))
    hybrid = {k: v for k, v in {**TINY_HYBRID, **overrides}.items()}
    if kind == "qwen3_5_moe":
        from transformers.models.qwen3_5_moe import Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig

        hybrid.pop("intermediate_size")
        return Qwen3_5MoeForCausalLM(Qwen3_5MoeTextConfig(**hybrid))
    if kind == "qwen3_5":
        from transformers.models.qwen3_5 import Qwen3_5ForCausalLM, Qwen3_5TextConfig

        for key in ("moe_intermediate_size", "shared_expert_intermediate_size", "num_experts", "num_experts_per_tok"):
            hybrid.pop(key)
        return Qwen3_5ForCausalLM(Qwen3_5TextConfig(**hybrid))
    if kind == "qwen3_5_moe_vl":  # the published *ForConditionalGeneration layout
        from transformers.models.qwen3_5_moe import Qwen3_5MoeConfig, Qwen3_5MoeForConditionalGeneration

        hybrid.pop("intermediate_size")
        vision = {"depth": 1, "hidden_size": 32, "intermediate_size": 64, "num_heads": 2, "out_hidden_size": 64,
                  "patch_size": 4, "temporal_patch_size": 1, "spatial_merge_size": 1}
        return Qwen3_5MoeForConditionalGeneration(Qwen3_5MoeConfig(text_config=hybrid, vision_config=vision))
    raise ValueError(kind)


@pytest.fixture(scope="session", autouse=True)
def _outside_the_checkout(tmp_path_factory):
    """Every test (its fixtures, forked ranks and subprocesses without a cwd of their own) runs in a temporary
    folder, so a relative path (the examples' default train.output_dir: outputs/...) never lands in, or reads
    what the README's demo left in, the checkout. Session scope: set before any module fixture runs."""
    home = os.getcwd()
    os.chdir(tmp_path_factory.mktemp("cwd"))
    yield
    os.chdir(home)


@pytest.fixture(autouse=True)
def _older_objects_frozen():
    """The objects alive before a test are frozen out of Python's full collections (gc.freeze): those the
    collector runs by itself and the trainer's at the start of a run (runtime.observe.gc_schedule) pass over
    what the test made, not the whole session's heap (modules, compiled graphs: ~0.3 s a pass, ~10% of the
    in-process training tests' time). Whoever unfreezes (gc_schedule, run_dist) hands them back to the
    collector; the session unfreezes them at its end."""
    gc.freeze()
    yield


@pytest.fixture(scope="session", autouse=True)
def _unfrozen_at_exit():
    yield
    gc.unfreeze()  # what is garbage by then is freed before the interpreter's exit


_CORPORA: dict = {}


@pytest.fixture
def tokenize_once(monkeypatch):
    """runtime.data.loader.build_corpus memoized for the session by data config, tokenizer and file: the tiny
    example's 3,000 chat records cost ~2 s of CPU to tokenize in every process that builds a loader (each rank
    and the single-process reference of a parity case), and give the same corpus every time. Ranks forked
    after this process built it (run the reference first) reuse it. What tokenizing and packing do is
    tests/unit/test_data.py's; a hit skips the corpus's log lines. Returns prime(cfg): builds the corpus of a
    run config here, before ranks are forked."""
    from runtime.data import loader
    from runtime.data.chat import load_tokenizer

    build = loader.build_corpus

    def memoized(cfg, tokenizer):
        source = Path(cfg.path).stat()
        key = (cfg.model_dump_json(), tokenizer.name_or_path, source.st_mtime_ns, source.st_size)
        if key not in _CORPORA:
            _CORPORA[key] = build(cfg, tokenizer)
        return _CORPORA[key]
    monkeypatch.setattr(loader, "build_corpus", memoized)
    return lambda cfg: memoized(cfg.data, load_tokenizer(cfg.data.tokenizer or cfg.model.path))


@pytest.fixture(scope="session")
def tiny_moe_ckpt(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_moe")
    write_hf_checkpoint(path, "moe")
    return path


def _forked_python(code: str, stderr_path: str, new_session: bool, stdout_path: str) -> None:
    """The child of Forked: `code` as `python -c code` runs it, then the exit (os._exit: no teardown of the
    test session it was forked from)."""
    if new_session:
        os.setsid()
    signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C as in a terminal, also in background
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    err = open(stderr_path, "w", buffering=1)  # noqa: SIM115 (open until os._exit)
    out = open(stdout_path, "w", buffering=1)  # noqa: SIM115
    os.dup2(err.fileno(), 2)
    os.dup2(out.fileno(), 1)
    sys.stderr, sys.stdout = err, out
    logging.root.handlers.clear()  # the session's capture handlers: a fresh process has none
    torch.set_num_threads(1)  # OMP_NUM_THREADS=1 of the tests' subprocesses
    exit_code = 0
    try:
        exec(compile(code, "<string>", "exec"), {"__name__": "__main__"})  # noqa: S102 (the test's own code)
    except SystemExit as done:
        exit_code = done.code if isinstance(done.code, int) else (0 if done.code is None else 1)
    except BaseException:  # noqa: BLE001 (as Python reports an uncaught error)
        import traceback

        traceback.print_exc()
        exit_code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(exit_code)


class Forked:
    """Python code run as `python -c CODE` would run it, in a child forked from this process instead of a new
    Python: torch, transformers and the runtime are imported already (~3 s less per run). Its own pid, process
    group (new_session) and signals; stderr in a file, stdout in one or dropped; the session's log handlers
    dropped (a fresh process's logging). Popen's subset the tests use: pid, poll, wait, communicate,
    send_signal, kill, returncode (-N: ended by signal N)."""

    def __init__(self, code: str, stderr_path, new_session: bool = False, stdout_path=None):
        import multiprocessing

        self.stderr_path = Path(stderr_path)
        self.stdout_path = Path(stdout_path) if stdout_path else None
        for path in (self.stderr_path, self.stdout_path):
            if path:
                path.touch()  # readable (empty) before the child opens it
        self._process = multiprocessing.get_context("fork").Process(
            target=_forked_python, args=(code, str(self.stderr_path), new_session,
                                         str(self.stdout_path or os.devnull)))
        self._process.start()
        self.pid = self._process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        if self._process.exitcode is None:
            import subprocess

            raise subprocess.TimeoutExpired(f"forked {self.pid}", timeout)
        return self._process.exitcode

    def communicate(self, timeout: float | None = None) -> tuple[str, str]:
        self.wait(timeout)
        return self.stdout_path.read_text() if self.stdout_path else "", self.stderr_path.read_text()

    def send_signal(self, sig: int) -> None:
        os.kill(self.pid, sig)

    def kill(self) -> None:
        if self._process.exitcode is None:
            os.kill(self.pid, signal.SIGKILL)


def forked_launch(args: list, stderr_path, new_session: bool = False) -> Forked:
    """`python -m runtime.launch ARGS` in a forked child (Forked)."""
    return Forked(f"import sys\nfrom runtime.launch import main\nsys.exit(main({[str(a) for a in args]!r}))",
                  stderr_path, new_session)


@dataclass
class Finished:
    """How a run of the command ended: its exit code and what it printed on stderr."""

    returncode: int
    stderr: str


class _Exited(BaseException):
    """guarded_main's os._exit(code), raised instead of ending the test process."""

    def __init__(self, code: int):
        super().__init__(code)
        self.code = code


def _raise_exited(code: int):
    raise _Exited(code)


@pytest.fixture
def cli(capsys):
    """`python -m runtime.launch ARGS` run in this process: cli(args) -> Finished. runtime.launch's main
    as the command runs it (argv, config, preflight, training, guarded_main's failure report), its closing
    os._exit turned into the exit code: an error case costs what it checks, not a Python start with torch.
    The log goes to stderr as in a plain process (setup_logging's basicConfig does nothing under pytest's
    log capture); the signal handlers guarded_main sets are put back."""
    from runtime.launch import main

    def run(args: list) -> Finished:
        handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
        root = logging.getLogger()
        level = root.level
        log_to_stderr = logging.StreamHandler(sys.stderr)
        log_to_stderr.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s", "%H:%M:%S"))
        root.addHandler(log_to_stderr)
        root.setLevel(logging.INFO)
        capsys.readouterr()
        try:
            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(os, "_exit", _raise_exited)
                code = main([str(a) for a in args])
        except _Exited as exited:
            code = exited.code
        finally:
            root.removeHandler(log_to_stderr)
            root.setLevel(level)
            for signum, handler in handlers.items():
                signal.signal(signum, handler)
        return Finished(code, capsys.readouterr().err)
    return run


class Ahead:
    """A test's work outside this process (a fresh Python, torchrun and its workers), done ahead of the test on a
    lane beside the session: on CI's two cores the in-process tests keep one busy, and the lane the other.

        JOB = Ahead(lambda tmp: subprocess.run([...], cwd=tmp, capture_output=True, ...))   # module level

        @pytest.mark.ahead(JOB)
        def test_x():
            done = JOB.result()    # what the job returned, or the error it raised

    The session moves the marked tests to its end and starts their jobs, one at a time in test order, on one
    thread at a lower priority (LANE_NICE) once the tests of tests/dist (whose ranks use both cores) are over;
    each job gets a temporary folder of its own. The job runs on that thread: it may start and wait on processes
    (subprocess: fork and exec) with the environment lane_environ(), never fork this process (multiprocessing,
    Forked) nor compute with torch. Timing
    checks stay in the session (a starved job only ends later). A test whose job has not started by then (run
    alone, or -k) runs it itself."""

    def __init__(self, job: Callable[[Path], Any]):
        self.job = job
        self._lock = threading.Lock()
        self._started = False
        self._done = threading.Event()
        self._outcome: tuple[Any, BaseException | None] = (None, None)

    def run(self, tmp: Path) -> None:
        """The job, unless it has started already."""
        with self._lock:
            if self._started:
                return
            self._started = True
        try:
            self._outcome = (self.job(tmp), None)
        except BaseException as err:  # noqa: BLE001 (the test re-raises it)
            self._outcome = (None, err)
        finally:
            self._done.set()

    def result(self) -> Any:
        if not self._started:
            self.run(_LANE.tmp_path_factory.mktemp("ahead"))
        self._done.wait()
        value, err = self._outcome
        if err is not None:
            raise err
        return value


class _Lane:
    """The session's Ahead jobs (those of the selected tests, in test order) and the thread that runs them."""

    def __init__(self):
        self.jobs: list[Ahead] = []
        self.thread: threading.Thread | None = None
        self.closing = False
        self.tmp_path_factory = None
        self.environ: dict[str, str] | None = None

    def start(self, tmp_path_factory) -> None:
        runs = [(job, tmp_path_factory.mktemp("ahead")) for job in self.jobs]  # here: mktemp is not threadsafe
        self.environ = dict(os.environ)

        def lane():
            # Below the tests in priority, and so the processes it starts: the lane takes the core they leave
            # idle, never theirs (Linux: a thread's own nice value, which its children inherit).
            if sys.platform == "linux":  # elsewhere the call would lower the whole session
                os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), LANE_NICE)
            for job, tmp in runs:
                if self.closing:
                    return
                job.run(tmp)
        self.thread = threading.Thread(target=lane, name="ahead", daemon=True)
        self.thread.start()


_LANE = _Lane()
LANE_NICE = 10


def lane_environ() -> dict[str, str]:
    """The environment of an Ahead job's processes: the session's as the lane started, not what a test running
    meanwhile set (monkeypatch.setenv of WORLD_SIZE, say) and os.environ shows to every thread."""
    return dict(_LANE.environ if _LANE.environ is not None else os.environ)
_DIST = Path(__file__).resolve().parent / "dist"


@pytest.hookimpl(trylast=True)  # after -k and -m have deselected
def pytest_collection_modifyitems(items):
    """Tests marked ahead go last: the jobs they read get the rest of the session to run in."""
    items.sort(key=lambda item: item.get_closest_marker("ahead") is not None)  # stable
    for item in items:
        if any(mark.name == "skip" or (mark.name == "skipif" and mark.args and not isinstance(mark.args[0], str)
                                       and mark.args[0]) for mark in item.iter_markers()):
            continue  # skipped here: nothing will read its job
        for marker in item.iter_markers("ahead"):
            _LANE.jobs.extend(job for job in marker.args if job not in _LANE.jobs)


@pytest.fixture(autouse=True)
def _ahead_lane(request, tmp_path_factory):
    """Starts the Ahead lane at the first test outside tests/dist (or at a marked test, whichever comes first)."""
    _LANE.tmp_path_factory = tmp_path_factory
    if _LANE.thread is None and _LANE.jobs and (not request.node.path.is_relative_to(_DIST)
                                                 or request.node.get_closest_marker("ahead")):
        _LANE.start(tmp_path_factory)


@pytest.fixture(scope="session", autouse=True)
def _ahead_lane_closed():
    yield
    _LANE.closing = True  # a session cut short (-x) waits for the running job only
    if _LANE.thread is not None:
        _LANE.thread.join()
