"""mega's own implementations of the lifecycle hooks (``mega.plugins.lifecycle``): the metrics
sinks on ``step_end``/``checkpoint_saved``/``shutdown``, the plan check on
``topology_ready``/``step_end``/``shutdown``, the "saved checkpoint" line on ``checkpoint_saved``;
and the arguments those hooks gained (``engine``, ``seconds``), which implementations written
before them may leave out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from mega import hookimpl
from mega.core.config.resolve import resolve_config
from mega.core.console.display import Display
from mega.core.plan.check import PlannedRun
from mega.core.plugins.manager import make_plugins
from mega.core.training.engine import Engine
from mega.plugins.lifecycle import plan_check

from conftest import TINY

# 5 iterations, lines at 1, 2, 4, 5, evaluations at 2 and 4 and at the end, saves at 2, 4, 5
RUN = [*TINY, "--train-iters", "5", "--log-interval", "2", "--eval-interval", "2",
       "--eval-iters", "1", "--save-interval", "2"]  # fmt: skip


def train(tmp_path: Path, *extra_plugins, args: list[str] = RUN) -> Engine:
    plugins = make_plugins(extra=[(type(p).__name__, p) for p in extra_plugins])
    argv = [*args, "--save", str(tmp_path / "ckpt")]
    engine = Engine(resolve_config(argv, plugins), plugins, Display(rich_output=False))
    engine.train()
    return engine


def kinds(path: Path) -> list[tuple[int, str]]:
    """(iteration, what) of each record of ``metrics.jsonl``: ``line``, ``valid``, ``test``."""
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    split = lambda r: next(k for k in r if k.endswith("_lm_loss")).split("_")[0]  # noqa: E731
    return [(r["iteration"], "line" if "lm_loss" in r else split(r)) for r in rows]


def test_the_sinks_write_each_record_once_in_the_order_it_was_logged(tmp_path: Path, capsys):
    engine = train(tmp_path)
    metrics = tmp_path / "ckpt" / "metrics.jsonl"
    assert kinds(metrics) == [
        (1, "line"), (2, "line"), (2, "valid"), (4, "line"), (4, "valid"), (5, "line"),
        (5, "valid"),
    ]  # fmt: skip
    last = json.loads(metrics.read_text().splitlines()[5])
    assert (last["skipped_total"], last["nan_total"]) == (0, 0)
    assert {k: last[k] for k in ("iteration", "consumed_samples")} == {
        "iteration": 5,
        "consumed_samples": 40,
    }
    assert engine.iteration == 5
    out = capsys.readouterr().out
    for iteration in (2, 4):
        assert f" saved checkpoint at iteration {iteration:8d} to {tmp_path}/ckpt/iter_" in out
    assert out.count(" saved checkpoint at iteration ") == 3 and " s\n" in out


def test_a_plugin_failing_in_step_end_takes_no_record_away(tmp_path: Path):
    # the sinks' step_end runs first (tests/test_interruptions.py: a Ctrl-C in a hanging one)
    class Fails:
        @hookimpl
        def step_end(self, engine, iteration, metrics):
            metrics["not_recorded"] = 1
            if iteration == 2:
                raise RuntimeError("a plugin's bug")

    with pytest.raises(RuntimeError, match="a plugin's bug"):
        train(tmp_path, Fails(), args=[*TINY, "--train-iters", "3"])
    rows = [json.loads(r) for r in (tmp_path / "ckpt" / "metrics.jsonl").read_text().splitlines()]
    assert [r["iteration"] for r in rows] == [1, 2]
    assert not any("not_recorded" in r for r in rows)


def test_a_complete_checkpoint_has_every_record_before_it_on_disk(tmp_path: Path):
    # an evaluation's record waits for the next hook; checkpoint_saved is one, so a run killed
    # right after a save resumes with a metrics.jsonl that holds the evaluation before it
    seen = {}

    class Peek:
        @hookimpl
        def checkpoint_saved(self, path, iteration):
            seen[iteration] = kinds(Path(path).parent / "metrics.jsonl")[-1]

    train(tmp_path, Peek())
    assert seen == {2: (2, "valid"), 4: (4, "valid"), 5: (5, "line")}


def test_blocking_the_built_ins_takes_their_output_away(tmp_path: Path, monkeypatch, capsys):
    # the sinks and the line are plugins only: nothing else in mega writes them
    monkeypatch.setenv("MEGA_BLOCK_PLUGINS", "metrics_sinks,checkpoint_line")
    engine = train(tmp_path, args=[*TINY, "--train-iters", "2"])
    assert (engine.run_dir / "config.resolved.toml").is_file()
    assert not (engine.run_dir / "metrics.jsonl").exists()
    assert (tmp_path / "ckpt" / "iter_0000002" / "complete.json").is_file()
    assert "saved checkpoint" not in capsys.readouterr().out


def test_the_wandb_sink_is_wired_through_the_plugin(tmp_path: Path, monkeypatch):
    # tests/test_megatron_flags.py runs the real package when it is installed; this one does
    # not need it: a stand-in records what the sink asked of it, for a whole run
    import importlib.machinery
    import sys
    import types

    calls: list[tuple] = []

    class Run:
        def log(self, data, step):
            calls.append(("log", step, sorted(data)))

        def finish(self):
            calls.append(("finish",))

    fake = types.ModuleType("wandb")
    fake.__spec__ = importlib.machinery.ModuleSpec("wandb", None)  # found by find_spec
    fake.init = lambda **kw: calls.append(("init", kw["project"], kw["dir"])) or Run()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    args = [*TINY, "--train-iters", "2", "--eval-interval", "2", "--eval-iters", "1",
            "--wandb-project", "p"]  # fmt: skip
    train(tmp_path, args=args)
    assert calls[0] == ("init", "p", str(tmp_path / "ckpt" / "wandb"))
    assert calls[1][:2] == ("log", 1) and "lm loss" in calls[1][2]
    assert calls[2][:2] == ("log", 2)
    assert calls[3:] == [
        ("log", 2, ["lm loss validation"]),  # the evaluation at 2
        ("log", 2, ["lm loss validation"]),  # and at the end of training
        ("finish",),
    ]


def test_implementations_without_the_new_arguments_still_run(tmp_path: Path):
    # topology_ready gained engine, checkpoint_saved engine and seconds: pluggy passes an
    # implementation only the arguments it names
    calls: list[tuple] = []

    class Old:
        @hookimpl
        def topology_ready(self, topology):
            calls.append(("old topology", topology.world_size))

        @hookimpl
        def checkpoint_saved(self, path, iteration):
            calls.append(("old saved", iteration))

    class New:
        @hookimpl
        def topology_ready(self, topology, engine):
            calls.append(("new topology", engine.topology is topology))

        @hookimpl
        def checkpoint_saved(self, path, iteration, engine, seconds):
            calls.append(("new saved", engine.iteration, seconds is not None and seconds >= 0))

    train(tmp_path, Old(), New(), args=[*TINY, "--train-iters", "1"])
    assert sorted(calls) == [
        ("new saved", 1, True),
        ("new topology", True),
        ("old saved", 1),
        ("old topology", 1),
    ]


def test_an_async_save_is_reported_without_a_time(tmp_path: Path, capsys):
    seen = []

    class Times:
        @hookimpl
        def checkpoint_saved(self, iteration, seconds):
            seen.append((iteration, seconds))

    args = [*TINY, "--train-iters", "2", "--save-interval", "1", "--async-save"]
    train(tmp_path, Times(), args=args)
    assert seen == [(1, None), (2, None)]
    assert f" saved checkpoint at iteration        2 to {tmp_path}/ckpt/iter_0000002\n" in (
        capsys.readouterr().out
    )


# ----------------------------------------------------------------------- the plan check, alone


class FakePlanner:
    """A PlanCheck that reports ``planned`` once asked ``after`` times (or waited for)."""

    def __init__(self, planned: PlannedRun, after: int) -> None:
        self.planned, self.after, self.waits, self.stopped = planned, after, [], False

    def result(self, wait_s: float = 0.0):
        self.waits.append(wait_s)
        return self.planned if len(self.waits) > self.after or wait_s > 0 else None

    def stop(self) -> None:
        self.stopped = True


class FakeLog:
    def __init__(self) -> None:
        self.written: list[dict] = []

    def write(self, record: dict) -> None:
        self.written.append(record)


class FakeEngine:
    def __init__(self, train_iters: int) -> None:
        self.config = type("Config", (), {"train_iters": train_iters})()
        self.device, self.iteration, self.log = "cuda:0", 0, FakeLog()
        self.lines: list[str] = []
        self.display = type("D", (), {"print": lambda _, text: self.lines.append(text)})()


RANK0 = type("Topology", (), {"is_rank0": True})()


@pytest.fixture
def hook():
    """The lifecycle hooks of a plugin manager holding the plan check alone."""
    import pluggy

    from mega.core.plugins import hookspecs

    pm = pluggy.PluginManager("mega")
    pm.add_hookspecs(hookspecs)
    pm.register(plan_check)
    return pm.hook


@pytest.fixture
def planner(monkeypatch):
    """Each test's FakePlanner, handed to the plugin in place of the child process."""
    made = []

    def start(config, device):
        made.append(FakePlanner(PlannedRun((1.0, 2.0)), after=1))
        return made[-1]

    monkeypatch.setattr("mega.core.plan.check.start_plan_check", start)
    return made


def line(iteration: int, peak: float) -> dict:
    return {"iteration": iteration, "elapsed_ms": 1.0, "max_memory_gb": peak}


def test_the_plan_check_reports_beside_the_first_line_after_the_planner(planner, hook):
    engine = FakeEngine(train_iters=10)
    hook.topology_ready(topology=RANK0, engine=engine)
    first, second = line(1, 2.5), line(2, 2.5)
    hook.step_end(engine=engine, iteration=1, metrics=first)
    hook.step_end(engine=engine, iteration=2, metrics=second)
    hook.step_end(engine=engine, iteration=3, metrics=line(3, 2.5))
    assert "planned_memory_gb" not in first and second["planned_memory_gb"] == 2.0
    assert engine.lines == [PlannedRun((1.0, 2.0)).memory_line(2.5)]
    assert "planned 2.00 GiB by mega plan (-20.0%)" in engine.lines[0]
    assert planner[0].waits == [0.0, 0.0]  # not asked again once it reported
    hook.shutdown(engine=engine, exc=None)
    assert engine.log.written == []


def test_a_short_run_waits_for_the_planner_at_its_last_line(planner, hook):
    engine = FakeEngine(train_iters=1)
    hook.topology_ready(topology=RANK0, engine=engine)
    metrics = line(1, 2.0)
    hook.step_end(engine=engine, iteration=1, metrics=metrics)
    assert planner[0].waits == [plan_check.WAIT_AT_END_S]
    assert metrics["planned_memory_gb"] == 2.0 and len(engine.lines) == 1


def test_a_run_stopped_early_reports_at_shutdown_in_a_record_of_its_own(planner, hook):
    engine = FakeEngine(train_iters=100)
    hook.topology_ready(topology=RANK0, engine=engine)
    hook.step_end(engine=engine, iteration=1, metrics=line(1, 4.0))
    engine.iteration = 7
    hook.shutdown(engine=engine, exc=None)
    assert engine.log.written == [{"iteration": 7, "max_memory_gb": 4.0, "planned_memory_gb": 2.0}]
    assert planner[0].stopped and len(engine.lines) == 1


def test_a_failed_run_ends_the_planner_without_waiting(planner, hook):
    engine = FakeEngine(train_iters=100)
    hook.topology_ready(topology=RANK0, engine=engine)
    hook.step_end(engine=engine, iteration=1, metrics=line(1, 4.0))
    hook.shutdown(engine=engine, exc=RuntimeError("boom"))
    assert planner[0].stopped and planner[0].waits == [0.0]
    assert engine.lines == [] and engine.log.written == []


def test_the_plan_check_runs_on_rank_0_only(planner, hook):
    hook.topology_ready(topology=type("T", (), {"is_rank0": False})(), engine=FakeEngine(1))
    assert planner == []
