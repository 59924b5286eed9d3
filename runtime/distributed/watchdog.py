"""Stall watchdog: when one rank stops responding, every rank exits, and the rank is named.

Contract
    wd = Watchdog(rank, world_size, timeout_s, store_host, store_port); wd.start()
    - Every `interval_s = heartbeat_interval(timeout_s)` (timeout/10, within 0.5..10 s) a daemon thread
      writes this rank's heartbeat to the c10d store torchrun rendezvoused on (MASTER_ADDR:MASTER_PORT).
    - A rank whose heartbeat has not advanced for `timeout_s` is stalled (SIGSTOP, killed, swapping
      to death, host gone): the rank watching it prints ONE line to stderr,
          error: rank R (host H, pid P) stopped responding for T s (parallelism.collective_timeout_s=N);
          every rank stops now. <what to check>
      posts it to the store, and exits with EXIT_CODE; the other ranks read it there and exit too,
      quietly (rank 0 repeats the line when the rank that found the stall is on another host, whose
      log may not be the one users read). Every rank still running has exited within
      timeout_s + 3 * interval_s of the stall.
    - The store itself failing (its process, torchrun's agent on the first node, has ended: at once)
      or silent for `timeout_s` (frozen, or its host gone): each rank prints one line naming the
      store and exits with EXIT_CODE. Ranks on other nodes learn of a stall found on the first node
      this way when that node's torchrun ends before they read the verdict.
    - Normal end: at interpreter exit (atexit) the rank marks itself done, so peers still finishing
      (an export on rank 0, say) never take it for stalled; nothing is printed and nothing waits for
      longer than one store write.
    - Its own slowness is not a peer's stall: a rank whose watchdog threads were themselves frozen
      (SIGSTOP then SIGCONT) measures silence afresh instead of blaming its peer.
    - wd.check_now(wait_s), for a failure handler (process_group.defer_to_watchdog): one store round
      at once; when a stall was posted, or the store does not answer, the process ends inside it, else
      it returns within wait_s.

Design, and why
    - Heartbeats come from a thread, not from the training loop: a rank legitimately busy in a long
      phase without collectives (an evaluation, a save, a slow first step) keeps beating, so only a
      frozen or dead process goes silent. A stuck collective on live ranks is the collective
      timeout's business (the backend raises), not the watchdog's.
    - The store is the one torchrun already runs (its agent hosts it with TORCHELASTIC_USE_AGENT_STORE;
      without an agent, rank 0's process does): no port to choose, reachable from every node. The
      watchdog opens its own client connection: the default group's client is used by the main
      thread, and a store call of one thread blocking the other's is exactly the hang to avoid.
    - Counters, not timestamps: the observer times silence with its own monotonic clock, so host
      clocks need not agree.
    - A ring: rank r watches the next rank that has not finished (r+1, skipping done ones), one read
      per beat, so the store's load grows with the world size, not with its square. The rank that
      sees the stall posts the line under one `abort` key that every rank reads each beat: one line
      in the log instead of one per rank, and ranks on other nodes learn who stalled. Should the
      watcher be frozen too, the rank before it sees that first.
    - Two threads: a TCPStore call on a store whose process is frozen never returns (measured on
      torch 2.13: get/check/add/multi_get and even connecting ignore the client timeout once the
      server stops answering), so the store thread cannot be its own judge. A guard thread, which
      never touches the store, ends the process once the store thread has made no round for
      timeout_s.
    - Exit with os._exit: the main thread may sit in a collective that would never return, and
      torchrun stops the other local ranks as soon as one exits.
    - The process group's timeout is timeout_s + collective_grace(timeout_s) (process_group): with a
      frozen peer the watchdog, which names it, acts before the backend's anonymous "Timed out
      waiting ..." error.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import sys
import threading
import time
from datetime import timedelta

import torch.distributed as dist

EXIT_CODE = 1
TIMEOUT_KEY = "parallelism.collective_timeout_s"


def heartbeat_interval(timeout_s: float) -> float:
    """Seconds between heartbeats: a tenth of the timeout (detection within timeout + 2 intervals),
    at least 0.5 s (store load), at most 10 s (a frozen rank is named close to the timeout)."""
    return min(max(timeout_s / 10, 0.5), 10.0)


def collective_grace(timeout_s: float) -> float:
    """Extra seconds a collective may wait beyond timeout_s: the watchdog's worst detection delay
    (2 intervals), the other ranks' read of its verdict (1 interval), and 2 intervals of slack."""
    return 5 * heartbeat_interval(timeout_s)


def _short(err: BaseException) -> str:
    """First line of a c10d error (their str() carries a C++ stack trace)."""
    text = str(err).strip().splitlines()
    return f"{type(err).__name__}: {text[0] if text else ''}"[:200]


class Watchdog:
    """Heartbeats of this rank, watch over the next one; see the module docstring for the contract."""

    def __init__(self, rank: int, world_size: int, timeout_s: float, store_host: str, store_port: int):
        self.rank, self.world_size, self.timeout_s = rank, world_size, float(timeout_s)
        self.store_addr = (store_host, store_port)
        self.interval_s = heartbeat_interval(timeout_s)
        # torchrun's store outlives a restart of the workers: keys of an earlier attempt must not count.
        run = os.environ.get("TORCHELASTIC_RUN_ID", "run")
        attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
        self.prefix = f"runtime/watchdog/{run}/{attempt}"
        self.pid, self.host = os.getpid(), socket.gethostname()
        self._stop = threading.Event()
        self._wake = threading.Event()  # cuts the wait before the next store round short
        self._failing = threading.Event()
        self._started = 0  # store rounds begun
        self._rounds = 0  # store rounds completed; the guard watches it advance
        self._round_done_at = time.monotonic()
        self._threads: list[threading.Thread] = []

    # -- life cycle -------------------------------------------------------------------------------

    def start(self) -> Watchdog:
        for target, name in ((self._store_loop, "heartbeat"), (self._guard_loop, "store-guard")):
            t = threading.Thread(target=target, name=f"watchdog-{name}", daemon=True)
            t.start()
            self._threads.append(t)
        atexit.register(self.stop)
        return self

    def stop(self) -> None:
        """Marks this rank done and ends the threads; a no-op in a forked child (which has none)."""
        if os.getpid() != self.pid or self._stop.is_set():
            return
        self._stop.set()
        self._wake.set()
        if not self._threads:
            return
        # The store thread writes "done" and returns; bounded, since a store that stopped answering
        # would hold it forever.
        self._threads[0].join(timeout=min(self.interval_s, 2.0) + 1.0)

    def check_now(self, wait_s: float) -> None:
        """Runs a store round now and waits up to wait_s for it: if a peer has posted a stall, this
        process ends inside the round (see _Watch.round); otherwise this returns. A store that stopped
        answering holds the round: then this waits for the guard's verdict, which ends the process with
        the store's line (the error being handled is the echo of a peer's exit on that same verdict),
        and gives that verdict itself should the guard not have ruled by then."""
        if not self._threads or self._stop.is_set():
            return
        fresh = self._started + 1  # the first round to begin after this call (one may be under way)
        self._wake.set()
        # The guard rules by last round + timeout + 2 intervals on an idle host; on a loaded one its late
        # wake-ups read as its own freeze and restart the count, so three times that again is slack.
        last_round_at = self._round_done_at
        guard_verdict_at = last_round_at + 4 * (self.timeout_s + 2 * self.interval_s)
        deadline = max(time.monotonic() + wait_s, guard_verdict_at)
        while self._rounds < fresh and time.monotonic() < deadline:
            time.sleep(0.005)
        if self._rounds < fresh:
            # Returning would let the handler report the echo as its own error.
            self.fail(self._store_line(f"(no answer for {time.monotonic() - last_round_at:.0f} s, "
                                       f"{TIMEOUT_KEY}={self.timeout_s:g})"))

    # -- the store thread -------------------------------------------------------------------------

    def _key(self, rank: int) -> str:
        return f"{self.prefix}/heartbeat/{rank}"

    def _store_loop(self) -> None:
        try:
            store = dist.TCPStore(*self.store_addr, is_master=False, wait_for_workers=False,
                                  timeout=timedelta(seconds=max(self.interval_s, 1.0)))
            watch = _Watch(self)
            while not self._stop.is_set():
                self._started += 1
                watch.round(store, time.monotonic())
                self._rounds += 1
                self._round_done_at = time.monotonic()
                self._wake.wait(self.interval_s)
                self._wake.clear()
            store.set(self._key(self.rank), f"done {self.pid} {self.host}")
        except (RuntimeError, OSError) as err:  # c10d's errors are RuntimeErrors
            # An answer that is an error (connection reset, refused) means the store's process is gone,
            # and with it the run's torchrun: no point in waiting. (A frozen store gives no answer at
            # all: the guard reports that after timeout_s.)
            if not self._stop.is_set():
                self.fail(self._store_line(f"({_short(err)})"))

    # -- the guard thread -------------------------------------------------------------------------

    def _guard_loop(self) -> None:
        seen_rounds, seen_at = -1, time.monotonic()
        previous = seen_at
        while not self._stop.wait(self.interval_s):
            now = time.monotonic()
            if now - previous > self.timeout_s / 2:
                seen_at = now  # this process was frozen itself: silence measured across it means nothing
            previous = now
            if self._rounds != seen_rounds:
                seen_rounds, seen_at = self._rounds, now
            elif now - seen_at >= self.timeout_s and not self._stop.is_set():
                self.fail(self._store_line(f"(no answer for {now - seen_at:.0f} s, {TIMEOUT_KEY}="
                                           f"{self.timeout_s:g})"))

    def _store_line(self, why: str) -> str:
        host, port = self.store_addr
        # torchrun's agent hosts the store (TORCHELASTIC_USE_AGENT_STORE); without it, rank 0's process does.
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            owner = f"torchrun on the first node ({host}): its log says whether it ended, or check that node"
        else:
            owner = f"rank 0's process ({host}): check that process and its host"
        return (f"error: rank {self.rank} lost the rendezvous store at {host}:{port} {why}; every rank stops "
                f"now. The store lives in {owner}.")

    def fail(self, line: str, store=None) -> None:
        """Prints `line` once, posts it for the other ranks, ends this process."""
        if self._failing.is_set():  # the other thread is already on it (its store write may hang)
            os._exit(EXIT_CODE)
        self._failing.set()
        _say(line)
        if store is not None:
            # A set is not acknowledged: it does not wait on a store that stopped answering.
            with contextlib.suppress(RuntimeError, OSError):
                store.set(f"{self.prefix}/abort", f"{self.host}\t{line}")
        sys.stdout.flush()
        os._exit(EXIT_CODE)


def _say(line: str) -> None:
    """Writes `line` to stderr in one write, so lines of ranks sharing a pipe never interleave."""
    sys.stderr.flush()
    try:
        os.write(sys.stderr.fileno(), (line + "\n").encode())
    except (OSError, ValueError, AttributeError):  # a stderr without a file descriptor (a capture)
        print(line, file=sys.stderr, flush=True)


class _Watch:
    """The store thread's state: this rank's beat count and what it last saw of the rank it watches."""

    def __init__(self, wd: Watchdog):
        self.wd = wd
        self.beats = 0
        self.target: int | None = (wd.rank + 1) % wd.world_size  # None: every other rank is done
        self.value: str | None = None      # the target's last heartbeat ("count pid host"); None: none yet
        self.changed_at = time.monotonic()  # when that value last changed, on this rank's clock
        self.previous_round = self.changed_at

    def round(self, store, now: float) -> None:
        """Beat, obey an abort, then judge the watched rank."""
        wd = self.wd
        if now - self.previous_round > wd.timeout_s / 2:
            self.changed_at = now  # this process was frozen itself: do not blame the peer for its gap
        self.previous_round = now
        store.set(wd._key(wd.rank), f"{self.beats} {wd.pid} {wd.host}")
        self.beats += 1
        self._obey_abort(store)
        value = self._read_target(store, now)
        if self.target is None:
            return
        if value is not None and value != self.value:
            self.value, self.changed_at = value, now
        elif now - self.changed_at >= wd.timeout_s:
            wd.fail(self._stall_line(now), store)

    def _obey_abort(self, store) -> None:
        abort = f"{self.wd.prefix}/abort"
        if not store.check([abort]):
            return
        host, line = store.get(abort).decode().split("\t", 1)
        # Rank 0 repeats the line when a rank of another host found the stall: that host's log may not
        # be the one users read.
        if self.wd.rank == 0 and host != self.wd.host:
            _say(line)
        self.wd._failing.set()
        os._exit(EXIT_CODE)

    def _read_target(self, store, now: float) -> str | None:
        """The heartbeat of the next rank that is not done; None while its key does not exist yet
        (reading a missing key would wait for it; its silence is timed all the same)."""
        wd = self.wd
        while self.target is not None:
            key = wd._key(self.target)
            if self.value is None and not store.check([key]):
                return None
            value = store.get(key).decode()
            if not value.startswith("done"):
                return value
            # That rank ended normally: watch the one after it, timing it from now.
            following = (self.target + 1) % wd.world_size
            self.target = None if following == wd.rank else following
            self.value, self.changed_at = None, now
        return None

    def _stall_line(self, now: float) -> str:
        if self.value is None:
            who = f"rank {self.target} (no heartbeat ever arrived)"
        else:
            _, pid, host = self.value.split(" ", 2)
            who = f"rank {self.target} (host {host}, pid {pid})"
        return (f"error: {who} stopped responding for {now - self.changed_at:.0f} s "
                f"({TIMEOUT_KEY}={self.wd.timeout_s:g}); every rank stops now. Check that process (stopped? "
                "swapping? killed by the OOM killer: dmesg) and its host's network; raise "
                f"{TIMEOUT_KEY} only if it legitimately freezes that long.")
