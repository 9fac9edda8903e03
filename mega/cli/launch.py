"""``mega train --nproc-per-node N``: start the job's workers through torch's elastic launcher.

The parent has already validated the whole config (``resolve_config``), so every error is shown
before any worker exists. It then starts ``--nproc-per-node`` workers on this node with
``torch.distributed.launcher.api.elastic_launch`` (static rendezvous at --master-addr:--master-port,
node --node-rank of --nnodes, no restarts). Each worker runs the same ``mega train`` command; it
sees RANK, WORLD_SIZE, ... and so trains instead of launching again. Under ``torchrun`` or ``srun``
those variables are already set and ``mega train`` is itself one worker: nothing is launched.

Start method: fork, from a parent that has imported torch, the engine and torch._dynamo. A spawned
worker imports all of that again, at the same time as its siblings, on shared cores; a forked one
starts in milliseconds. Measured for the whole command (tiny GPT, 4 iterations, 2 CPU cores):
fork 2.3 s with 2 workers and 2.5 s with 4, spawn 5.0 s and 7.6 s, one process 2.6 s. On 2 H200s
(torch 2.11, NCCL, 5 iterations): fork 8.3-9.2 s, spawn 12.4 s, one GPU 8.4 s.

Forking is safe only while the parent has not initialised CUDA, and it never does: it imports
torch but runs nothing on a device, and every ``torch.cuda.is_available()`` in it (elastic's own
LaunchConfig's, a plugin's at import) asks NVML instead of the driver, through torch's documented
fork-safe check ``PYTORCH_NVML_BASED_CUDA_CHECK=1``, which ``mega.cli.main`` sets before any
plugin loads (a driver that answered once leaves the forked workers unable to use CUDA, and
``torch.cuda.is_initialized()`` does not say so). If something did initialise CUDA in the
parent (a plugin at import, say), tensorstore was used here (it aborts forked children that
use it), or other threads run here (a forked child has only the forking one:
``mega.parallel.fork_safety``), spawn is chosen instead. ``MEGA_START_METHOD=spawn``
forces it.

A failure on one rank ends the job: elastic notices the worker's exit within ``MONITOR_INTERVAL``
and stops the others (SIGTERM); the parent then prints one line naming the rank that failed first
(its own message is already on stderr) and exits 1, or 2 when that rank failed on bad input. Bad
input fails every rank alike, so when rank 0 failed on it, its own lines are all there is (exit 2);
the other ranks hold their copies back (``mega.cli.main``) until the parent has stopped them. The
others' collectives break when that rank's connections close; ``mega.cli.main`` holds such a
secondary failure back for ``peers.PEER_LOST_GRACE_S`` so that the launcher sees, and blames, the rank
that failed first. Ranks on other nodes, which no local launcher stops, then report it in one line.

SIGTERM to the launcher (``kill``, SLURM before a time limit) is passed on to the workers, and the
launcher goes on waiting for them: its exit code is theirs. With ``--exit-signal-handler`` they
finish the step, save and exit 0, and so does the launcher; without it they die from the signal and
the launcher says so (exit 1). Elastic's own SIGTERM handler is kept out (its
``signals_to_handle``): it stopped the workers itself and waited up to 30 s for them
to exit, which a worker that had returned never does (it waits for the parent to collect its
result, which elastic does only when not stopping), so the launcher killed it and exited 1 after
30 s, although every worker had saved.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import tempfile
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from mega.core.config.sections import RunConfig
from mega.errors import MegaRunError, MegaUsageError, first_line
from mega.parallel.distributed import process_place, url_host

START_METHODS = ("fork", "spawn", "forkserver")
# The signals elastic's handler turns into a SignalException in the launcher; SIGTERM is not one.
ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
STOPPED_BY_SIGTERM = "stopped by SIGTERM; the workers were stopped too"
MONITOR_INTERVAL = 0.1  # seconds between elastic's checks of its workers
# The loggers of torch elastic and of the process pool under it: their records (a traceback per
# failed worker, "Terminating process ... via signal SIGTERM") repeat what the workers said
# themselves and what the parent's summary line says; they are shown only when LOGLEVEL is set.
ELASTIC_LOGGERS = (
    "torch.distributed.elastic",
    "torch.distributed.launcher",
    "torch.multiprocessing",
)

# True inside a worker that ``launch_workers`` started (set by ``_worker``).
_launched_worker = False


def needs_launch(config: RunConfig) -> bool:
    """Whether this ``mega train`` must start the workers itself: more than one process asked for
    with ``--nproc-per-node``/``--nnodes``, and no launcher (torchrun, SLURM) started this one."""
    return process_place().source == "single" and config.launch.world_size > 1


def is_launched_worker() -> bool:
    """True in a worker started by ``mega train --nproc-per-node`` (whose parent already printed
    the warnings every rank would repeat, such as plugins that failed to load)."""
    return _launched_worker


def threads_per_worker(nproc_per_node: int) -> int:
    """CPU threads for each of ``nproc_per_node`` workers: this machine's cores shared out.

    torchrun sets 1, which avoids oversubscription but leaves a CPU-trained model (and any
    CPU-side work of a GPU one) on one core; an even share avoids oversubscription just as well.
    The cores are those this process may run on (a SLURM allocation or ``taskset`` limits them).
    """
    from mega.core.cores import available_cores

    return max(1, available_cores() // max(1, nproc_per_node))


def start_method() -> str:
    """fork (fast, see the module docstring) on Linux, unless CUDA is already initialised in this
    process or ``MEGA_START_METHOD`` names another; spawn elsewhere (macOS's system frameworks
    are not fork-safe, and Windows has no fork)."""
    chosen = os.environ.get("MEGA_START_METHOD", "").strip().lower()
    if chosen:
        if chosen not in START_METHODS:
            raise MegaUsageError(
                f"MEGA_START_METHOD={chosen}: use one of {', '.join(START_METHODS)}"
            )
        return chosen
    if not sys.platform.startswith("linux"):
        return "spawn"
    import torch

    from mega.parallel.fork_safety import fork_unsafe_reason

    # is_initialized() reads a flag; it does not initialise CUDA itself
    return "spawn" if torch.cuda.is_initialized() or fork_unsafe_reason() else "fork"


def launch_workers(config: RunConfig, argv: list[str], command: str = "train") -> None:
    """Run ``mega COMMAND argv`` (train, evaluate) as this node's ``--nproc-per-node`` workers; return when all finish.

    :raises MegaUsageError: the rank that failed first did so on bad input (its exit code 2).
    :raises MegaRunError: it failed otherwise or died from a signal, or the rendezvous failed.
    :raises KeyboardInterrupt: Ctrl-C (elastic has stopped the workers).
    """
    launch = config.launch
    method = start_method()
    if method == "fork":
        _preimport(compiles=_workers_may_compile(config))
    from torch.distributed.elastic.multiprocessing import DefaultLogsSpecs
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    elastic_signals = ",".join(sig.name for sig in ELASTIC_SIGNALS)
    env = {
        "PYTORCH_NVML_BASED_CUDA_CHECK": "1",  # see the module docstring: keeps fork safe
        # elastic writes its signals_to_handle here, for good: put the old value back after
        "TORCHELASTIC_SIGNALS_TO_HANDLE": elastic_signals,
    }
    if "OMP_NUM_THREADS" not in os.environ:
        env["OMP_NUM_THREADS"] = str(threads_per_worker(launch.nproc_per_node))
    timeout_s = max(1, int(config.parallel.distributed_timeout_minutes * 60))
    global _parent_plugins
    _parent_plugins = _invoking_plugins() if method == "fork" else None
    # mega running inside a process that captures its output in Python (a test's mega_cli): the
    # workers' output would go to the descriptors beneath it, so it goes to files and is relayed
    captured = not (_has_descriptor(sys.stdout) and _has_descriptor(sys.stderr))
    with (
        _environ(env),
        _quiet_elastic_logs(),
        _kept_signal_handlers(),
        tempfile.TemporaryDirectory(prefix="mega-launch-") as log_dir,
        _relay_from(log_dir, captured),
    ):
        sigterm = _SigtermForwarder()
        signal.signal(signal.SIGTERM, sigterm)
        elastic_config = LaunchConfig(
            min_nodes=launch.nnodes,
            max_nodes=launch.nnodes,
            nproc_per_node=launch.nproc_per_node,
            # every node's agent must name the same run: it prefixes the keys in the shared store
            run_id="mega",
            role="mega-train",
            rdzv_backend="static",
            rdzv_endpoint=f"{url_host(launch.master_addr)}:{launch.master_port}",
            rdzv_configs={"rank": launch.node_rank, "timeout": timeout_s},
            max_restarts=0,
            monitor_interval=MONITOR_INTERVAL,
            start_method=method,
            signals_to_handle=elastic_signals,  # not SIGTERM: _SigtermForwarder handles it
            logs_specs=_logs_specs(DefaultLogsSpecs, log_dir, captured),
        )
        try:
            elastic_launch(elastic_config, _worker)(list(argv), command)
        except ChildFailedError as exc:
            if exc.get_first_failure()[1].exitcode == 130:  # a rank ended on Ctrl-C before
                raise KeyboardInterrupt from None  # the launcher handled the SIGINT itself
            if sigterm.received and exc.get_first_failure()[1].exitcode == -signal.SIGTERM:
                raise MegaRunError(STOPPED_BY_SIGTERM) from None  # no --exit-signal-handler
            raise _failure_error(exc) from None
        except SignalException as exc:  # elastic has already stopped the workers
            if exc.sigval == signal.SIGINT:
                raise KeyboardInterrupt from None  # Ctrl-C: ends quietly with exit code 130
            raise MegaRunError(
                f"stopped by {exc.sigval.name}; the workers were stopped too"
            ) from None
        except (RuntimeError, ValueError, OSError) as exc:  # rendezvous: port in use, no master
            raise MegaRunError(_rendezvous_message(exc, config)) from None


_parent_plugins: Any = None  # the launching mega's plugins, which a forked worker runs with


def _invoking_plugins() -> Any:
    """The plugins of the ``mega`` command running here (a test's own included), or None."""
    try:
        from mega.cli import current_plugins

        return current_plugins()
    except RuntimeError:  # called outside a click command
        return None


def _has_descriptor(stream: Any) -> bool:
    """Whether ``stream`` writes to an OS file descriptor (a terminal, a pipe, a file), unlike
    an in-memory capture (``io.StringIO``)."""
    try:
        stream.fileno()
    except (AttributeError, OSError, ValueError):
        return False
    return True


def _logs_specs(specs_cls: Any, log_dir: str, captured: bool) -> Any:
    """Elastic's error files in ``log_dir``; when ``captured``, the workers' stdout and stderr
    too (relayed by :func:`_relay_from`)."""
    if not captured:
        return specs_cls(log_dir=log_dir)
    from torch.distributed.elastic.multiprocessing import Std

    return specs_cls(log_dir=log_dir, redirects=Std.ALL)


@contextlib.contextmanager
def _relay_from(log_dir: str, captured: bool) -> Iterator[None]:
    """When ``captured``: the process's own descriptors are ``sys.stdout``/``sys.stderr`` while
    the workers start (elastic's redirection needs file descriptors, and forked workers inherit
    these streams), and after the workers end, however they end, each rank's stdout and stderr
    files go, in rank order, to the streams that were capturing."""
    if not captured:
        yield
        return
    capturing = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = sys.__stdout__, sys.__stderr__
    try:
        yield
    finally:
        sys.stdout, sys.stderr = capturing
        for name, stream in (("stdout.log", capturing[0]), ("stderr.log", capturing[1])):
            for file in sorted(Path(log_dir).rglob(name), key=lambda f: int(f.parent.name)):
                stream.write(file.read_text(errors="replace"))


class _SigtermForwarder:
    """The launcher's SIGTERM handler while its workers run: it sends the signal on to them and
    returns, so that elastic keeps waiting for them and reports how they ended.

    The workers are this process's multiprocessing children (elastic's process context starts
    them; the launcher starts no others). With ``--exit-signal-handler`` the ranks agree to stop
    after the same step (an all-reduce), so a rank that the signal reaches late, or not at all,
    stops with the others. Before any worker has started (the rendezvous) there is nothing to
    pass it on to: the launcher stops as elastic's handler would have it.
    """

    def __init__(self) -> None:
        self.received = False

    def __call__(self, signum: int, frame: Any) -> None:
        import multiprocessing

        from torch.distributed.elastic.multiprocessing.api import SignalException

        self.received = True
        workers = multiprocessing.active_children()
        if not workers:
            sigval = signal.Signals(signum)
            raise SignalException(f"launcher got {sigval.name}", sigval=sigval)
        for worker in workers:
            with contextlib.suppress(ProcessLookupError):  # it ended meanwhile
                os.kill(worker.pid, signum)


def _workers_may_compile(config: RunConfig) -> bool:
    """Whether the workers may import torch._dynamo: ``--compile`` as given, else its default
    (on with CUDA), judged without a CUDA call before the fork (a CPU build of torch has none)."""
    import torch

    training = config.training
    if training.compile is not None:
        return training.compile
    return training.device != "cpu" and (torch.version.cuda or torch.version.hip) is not None


def _preimport(compiles: bool) -> None:
    """Import, once in the parent, what every forked worker would otherwise import at the same
    time on shared cores: torch and the engine (with its optimizer), and torch._dynamo where
    the workers may compile (3 s on this machine; an eager CPU run never imports it)."""
    if compiles:
        import torch._dynamo  # noqa: F401

    import mega.core.training.engine  # noqa: F401


def _failure_error(exc: Any) -> MegaRunError | MegaUsageError:
    """The one line that sums up a failed job: which rank failed first, and how."""
    rank, failure = exc.get_first_failure()
    code = failure.exitcode
    if code < 0:  # killed by a signal: it printed nothing of its own (a crash, the OOM killer)
        try:
            name = signal.Signals(-code).name
        except ValueError:
            name = f"signal {-code}"
        return MegaRunError(f"rank {rank} died from {name} (exit code {code})")
    if rank == 0 and code == 2:  # bad input: rank 0's own error lines say all there is to say
        return MegaUsageError([])  # (an error with no lines: exit code 2, nothing printed)
    message = f"rank {rank} failed (exit code {code}); see its message above"
    return MegaUsageError(message) if code == 2 else MegaRunError(message)


def _rendezvous_message(exc: BaseException, config: RunConfig) -> str:
    launch = config.launch
    first = first_line(exc)
    where = f"{launch.master_addr}:{launch.master_port}"
    if "EADDRINUSE" in first or "address already in use" in first.lower():
        return (
            f"cannot start the rendezvous at {where}: the port is in use (another job?);"
            " choose a free one with --master-port"
        )
    return f"rendezvous at {where} (node {launch.node_rank} of {launch.nnodes}) failed: {first}"


def _worker(argv: list[str], command: str) -> None:
    """One worker: ``mega COMMAND argv``, in a process that elastic started (RANK etc. are set)."""
    global _launched_worker
    _launched_worker = True
    # A forked worker inherits elastic's handlers, which turn SIGTERM into a Python exception
    # that waits for the current collective to return (minutes, in a hung job). Elastic stops the
    # ranks that did not fail with SIGTERM: they should just end. Ctrl-C is a KeyboardInterrupt.
    for sig in (signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT):
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, _interrupt_once)
    import torch

    # A forked worker's OpenMP runtime read OMP_NUM_THREADS when the parent loaded torch, before
    # the parent chose the per-worker share; set the share explicitly.
    threads = os.environ.get("OMP_NUM_THREADS", "")
    if threads.isdigit() and int(threads) > 0:  # not OpenMP's nested form "4,2"
        torch.set_num_threads(int(threads))
    from mega.cli import main

    try:
        # forked, the parent's plugins (a test's own too); spawned, this process's
        main([command, *argv], _parent_plugins)  # SystemExit: 0, 1 (run error) or 2 (bad input)
    except Exception:  # a bug, not an ordinary error: show it as Python would, then fail
        traceback.print_exc()
        sys.stderr.flush()
        raise SystemExit(1) from None


def _interrupt_once(signum: int, frame: Any) -> None:
    """Ctrl-C in a worker: one KeyboardInterrupt. A terminal's Ctrl-C reaches the worker, and
    then elastic forwards the parent's SIGINT to it too; a second KeyboardInterrupt would land in
    the middle of the first one's message or cleanup. SIGTERM is ignored from then on too: when
    another rank ends first, elastic stops the rest with SIGTERM, which would cut rank 0 off
    before its one-line message (seen once in a CI run on a loaded machine); elastic still
    SIGKILLs a worker whose cleanup hangs."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise KeyboardInterrupt


@contextlib.contextmanager
def _environ(values: dict[str, str]) -> Iterator[None]:
    """``os.environ`` with ``values`` set (the workers inherit them), restored afterwards."""
    saved = {key: os.environ.get(key) for key in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


@contextlib.contextmanager
def _quiet_elastic_logs() -> Iterator[None]:
    """Keep elastic's log records off stderr (unless LOGLEVEL asks for them): the workers'
    messages and the parent's summary line already say what happened."""
    if os.environ.get("LOGLEVEL"):
        yield
        return
    loggers = [logging.getLogger(name) for name in ELASTIC_LOGGERS]
    saved = [(lg.propagate, list(lg.handlers)) for lg in loggers]
    for lg in loggers:
        lg.propagate = False
        lg.handlers = [logging.NullHandler()]
    try:
        yield
    finally:
        for lg, (propagate, handlers) in zip(loggers, saved, strict=True):
            lg.propagate, lg.handlers = propagate, handlers


@contextlib.contextmanager
def _kept_signal_handlers() -> Iterator[None]:
    """Elastic installs its own SIGTERM/SIGINT/... handlers in the parent; put ours back after."""
    signals = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT)
    saved = {sig: signal.getsignal(sig) for sig in signals}
    try:
        yield
    finally:
        for sig, handler in saved.items():
            if handler is not None:
                signal.signal(sig, handler)
