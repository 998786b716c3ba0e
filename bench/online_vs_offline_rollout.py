"""Online against offline training of an autoregressive surrogate, at equal memory and wall time
(docs/explanation/performance.md#what-the-targets-are, row "online vs offline", the rollout error).

Experiment A of ``bench/online_vs_offline.py`` for a surrogate trained on
windows of steps (``training.window``, docs/how-to/windows.md): the
Gray–Scott example (``examples/reaction_diffusion``: two fields on a
periodic 64x64 grid, feed and kill rates and the initial spots' seed swept)
and its ``GrayScottSurrogate``, a CNN that maps 4 steps to the next. Both
sides get:

- the same simulations: the program ``examples/reaction_diffusion/simulation.py``,
  one process per simulation, one per core at a time, one thread each; online
  it streams its steps to the server, offline (``--output``) it writes them to
  a ``.npy`` file, read back before training;
- the same model, optimizer (fused Adam), lr, seed and per-step batch: online
  K ranks of ``batch / K`` windows each (gradients averaged), offline one
  process on ``batch``;
- the same wall-clock budget ``--seconds``, counted from the launch of each
  side's process: online, ``mpirun`` of the server, stopped by SIGTERM at the
  budget (a graceful stop), its model then exported (``--export-model``);
  offline, this script's ``--offline`` mode in a process of its own, whose
  generation of the data set and reading it back count;
- the same memory for steps: the K online Reservoirs hold ``--capacity``
  steps each; offline holds as many whole simulations as fit in K x capacity
  steps and trains shuffled epochs of their windows, while online streams as
  many simulations as its time allows through the Reservoirs;
- no validation inside the budget, and the same judge after it: the final
  model of each side rolled out (``melissa_dl.train.rollout.rollout_errors``,
  the server's own rollout validation: the module's ``rollout``, fed its own
  predictions from each trajectory's first 4 true steps) on the same
  ``--held-out`` trajectories, parameter sets drawn uniformly over the whole
  box with a seed of their own, solved once in this process before the first
  run (outside both budgets). The figure is the relative L2 error at the end
  of the trajectory (over both fields), averaged over the held-out
  trajectories; the errors 1 and 10 steps ahead are printed too.

The simulations' feed and kill rates span spots that split, labyrinths and
decay to a uniform state: which one a held-out pair gives is what a model
that has seen a few pairs gets wrong. Each of ``--seeds`` seeds (study
sampler and training seed) runs both sides, the first alternating with the
seed, in fresh folders. Ends with the median over seeds of the per-seed ratio
(> 1: online better)::

    RESULT online_vs_offline_rollout ratio=<offline end error / online end error> target=1.16 ...

    python bench/online_vs_offline_rollout.py [--seeds 3] [--seconds 90] [--capacity 150]

Measured on 2 cores of an AMD EPYC shared with other work, 90 s a side, 3
seeds: with the default 150 steps a rank (9.8 MB of steps; offline holds 6
simulations, online streamed about 110) the end error was 1.19x lower online
(per seed 1.21, 1.19, 1.09), although online trained fewer batches (median
612 against 877: its simulations share the cores with its ranks) and its
errors 1 and 10 steps ahead were no lower; with 250 steps a rank (16.4 MB, 10
simulations offline) 0.96x (1.09, 0.96, 0.87): offline's ten simulations and
its 1.6x more batches did as well. The ratio moves by about 0.1 from seed to
seed, and with the load of other processes on the cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

LAUNCHED = time.time()  # the offline side's clock starts with its process, before its imports
import numpy as np  # noqa: E402
from online_vs_offline import CORES, ONE_THREAD, run_for_budget  # noqa: E402  (bench/ is the script's folder)
from studies import ROOT, environment, mpirun  # noqa: E402

EXAMPLE = ROOT / "examples" / "reaction_diffusion"
sys.path.insert(0, str(EXAMPLE))  # the surrogate imports solver.py from its folder, before any other example's

import torch  # noqa: E402
from solver import FIELDS, GrayScott  # noqa: E402

from melissa_dl import Sample, TrainingModule  # noqa: E402
from melissa_dl.buffers.windows import Window, stacked, windows_of  # noqa: E402
from melissa_dl.config.sections import Config, TrainingConfig, load_config  # noqa: E402
from melissa_dl.study.sampling import parameter_table  # noqa: E402
from melissa_dl.train.dataset import collate  # noqa: E402
from melissa_dl.train.module import load_module_class  # noqa: E402
from melissa_dl.train.rollout import rollout_errors  # noqa: E402

HELD_OUT_STREAM = 0x48454C44  # "HELD": the held-out draws never coincide with a study's
HORIZONS = {"1": 0, "10": 9, "end": -1}  # the error of the predicted step at each horizon


@dataclass
class Run:
    """One side's run: what it got and its final model's rollout errors on the held-out trajectories."""

    side: str
    simulations: int
    unique_steps: int
    windows_trained: int
    batches: int
    training_s: float
    generation_s: float = 0.0
    errors: dict[str, float] = field(default_factory=dict)


def config_for(args: argparse.Namespace, seed: int, side: str, folder: Path) -> Path:
    """The example's config made into this run's: absolute paths, the bench's memory, batch, seed and study."""
    data = json.loads((EXAMPLE / "config.json").read_text())
    offline = side == "offline"
    data["output_dir"] = str(folder / side)
    data["server"]["status_interval"] = 0.5  # the last status before the stop gives the online side's counts
    # online: more than the budget lets it run (it stops on time); offline: the whole simulations its memory holds
    simulations = args.ranks * args.capacity // args.steps if offline else 5000
    data["study"].update(simulations=simulations, seed=seed, time_steps=args.steps)
    data["study"].pop("validation", None)  # no validation inside the budget, on either side
    command = data["launcher"]["command"]
    command[1] = str(EXAMPLE / command[1])
    command[command.index("--steps") + 1] = str(args.steps)
    data["launcher"].update(command=command, job_limit=len(CORES), env=ONE_THREAD)
    per_rank = args.batch // args.ranks
    data["buffer"].update(kind="reservoir", capacity_samples=args.capacity, per_server_watermark=2 * per_rank)
    training = data["training"]
    training.pop("epochs_after_data", None)
    training.update(module=str(EXAMPLE / "surrogate.py"), seed=seed, batch_size=args.batch if offline else per_rank)
    training["options"]["lr"] = args.lr
    data["checkpoint"] = {"interval": 0}
    path = folder / f"{side}.json"
    path.write_text(json.dumps(data, indent=2))
    return path


def held_out(config: Config, count: int) -> list[Sample]:
    """``count`` trajectories, parameters uniform over the study's box, solved here as the simulations solve them:
    each a ``Sample`` whose fields are ``[steps, n, n]``."""
    low = np.array([p.low for p in config.study.parameters])
    high = np.array([p.high for p in config.study.parameters])
    parameters = np.random.default_rng([HELD_OUT_STREAM, 1]).uniform(low, high, size=(count, len(low)))
    command = config.launcher.command
    grid = {name: int(command[command.index(f"--{name}") + 1]) for name in ("n", "substeps")}
    trajectories = []
    for i, values in enumerate(parameters):
        solved = GrayScott(*values, **grid).solve(config.study.time_steps or 0)
        fields = {name: np.ascontiguousarray(solved[:, j]) for j, name in enumerate(FIELDS)}
        trajectories.append(Sample(-1 - i, 0, values, fields))
    return trajectories


def training_of(config: Config) -> TrainingConfig:
    """The config's ``training`` section, which the example's config has, with its window."""
    assert config.training is not None and config.training.window is not None
    return config.training


def built_module(config: Config) -> TrainingModule:
    """The config's module, built as the server builds it: the training seed first, then the class."""
    training = training_of(config)
    torch.manual_seed(training.seed)
    module = load_module_class(config.base_dir / training.module, training.class_name)(**training.options)
    module.window = training.window
    return module


def judge(config: Config, model: Path, trajectories: list[Sample]) -> dict[str, float]:
    """The final model's rollout error at each horizon, averaged over the held-out trajectories."""
    module = built_module(config)
    module.load_state_dict(torch.load(model, weights_only=True))
    module.eval()
    window = training_of(config).window
    assert window is not None
    errors = np.array([rollout_errors(module, trajectory, window.inputs) for trajectory in trajectories])
    return {name: float(errors[:, at].mean()) for name, at in HORIZONS.items()}


def run_online(config: Path, args: argparse.Namespace) -> tuple[Run, Path]:
    """The server on K ranks, stopped by SIGTERM at the budget, its model exported."""
    output = Path(json.loads(config.read_text())["output_dir"])
    command = [mpirun(), "-n", str(args.ranks), sys.executable, "-m", "melissa_dl", "--fresh", str(config)]
    _, stopped = run_for_budget(command, config, args.seconds)
    status = json.loads((output / "status.json").read_text())  # the last one before the stop (no report then)
    run = Run(
        "online",
        simulations=status["simulations"]["done"],
        unique_steps=status["samples"]["received"],
        windows_trained=status["samples"]["consumed"],
        batches=status["training"]["batches"],
        training_s=stopped,  # from the launch: the server's start, its training and the simulations' run
    )
    return run, output / "model.pt"


def run_offline(config: Path, args: argparse.Namespace) -> tuple[Run, Path]:
    """This script's ``--offline`` mode in a process of its own, within the budget counted from its launch."""
    folder = config.parent
    model, report = folder / "offline_model.pt", folder / "offline_report.json"
    command = [sys.executable, __file__, "--offline", str(config), "--seconds", f"{args.seconds:.3f}"]
    command += ["--model", str(model), "--report", str(report)]
    done = subprocess.run(command, env=environment(), capture_output=True, text=True, timeout=args.seconds + 300)
    if done.returncode != 0:
        raise RuntimeError(f"the offline side exited {done.returncode}:\n{done.stderr[-2000:]}")
    got = json.loads(report.read_text())
    return Run("offline", **got), model


# ------------------------------------------------------------------ the offline side, in its own process
def generate(config: Config, folder: Path) -> np.ndarray:
    """Every simulation of the study (its sampler's parameter sets) written by the program to one ``.npy`` each,
    ``job_limit`` at a time; their parameters."""
    parameters = parameter_table(config.study, config.base_dir)
    folder.mkdir(parents=True, exist_ok=True)
    command = list(config.launcher.command)
    command[0] = sys.executable if command[0] == "python" else command[0]
    environ = {**os.environ, **config.launcher.env}

    def simulate(sim: int) -> None:
        values = map(repr, parameters[sim].tolist())
        out = ["--output", str(folder / f"simulation{sim}.npy"), "--parameters", *values]
        subprocess.run([*command, *out], env=environ, check=True, cwd=config.base_dir)

    with ThreadPoolExecutor(config.launcher.job_limit) as pool:
        list(pool.map(simulate, range(len(parameters))))
    return parameters


def load_windows(config: Config, folder: Path, parameters: np.ndarray) -> list[Window]:
    """Every window of the stored simulations, as the server makes them (``buffers.windows``)."""
    window = training_of(config).window
    assert window is not None
    steps = []
    for sim, values in enumerate(parameters):
        solved = np.load(folder / f"simulation{sim}.npy")
        steps += [Sample(sim, t, values, dict(zip(FIELDS, solved[t]))) for t in range(len(solved))]
    return windows_of(steps, window.length, window.stride)


def train_epochs(module: TrainingModule, windows: list[Window], batch: int, seed: int, deadline: float) -> int:
    """Shuffled epochs over the windows (the last partial batch dropped), each batch formed as the server forms
    one (``stacked``, ``process``, ``collate``), until the deadline; the batches trained."""
    optimizer = module.configure_optimizer()
    generator = torch.Generator().manual_seed(seed)
    module.train()
    batches = 0
    while time.time() < deadline:
        for chosen in torch.randperm(len(windows), generator=generator).split(batch):
            if len(chosen) < batch and len(windows) >= batch:
                continue
            samples, arrays = stacked([windows[i] for i in chosen.tolist()])
            loss = module.training_step(collate([module.process(s) for s in samples], arrays))
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            optimizer.step()
            batches += 1
            if time.time() >= deadline:
                break
    return batches


def offline_main(args: argparse.Namespace) -> int:
    """Generate, load and train within ``--seconds`` of this process's launch; the model and a report."""
    deadline = LAUNCHED + args.seconds
    config = load_config(args.offline)
    folder = args.offline.parent / "offline" / "simulations"
    started = time.time()
    parameters = generate(config, folder)
    windows = load_windows(config, folder, parameters)
    generation_s = time.time() - started
    module, training = built_module(config), training_of(config)
    started = time.time()
    batches = train_epochs(module, windows, training.batch_size, training.seed, deadline)
    torch.save(module.state_dict(), args.model)
    report = {
        "simulations": len(parameters),
        "unique_steps": len(parameters) * (config.study.time_steps or 0),
        "windows_trained": batches * training.batch_size,
        "batches": batches,
        "training_s": round(time.time() - started, 3),
        "generation_s": round(generation_s, 3),
    }
    args.report.write_text(json.dumps(report))
    return 0


# ------------------------------------------------------------------ the comparison
def run_seed(args: argparse.Namespace, seed: int, folder: Path, trajectories: list[Sample]) -> tuple[Run, Run]:
    """Both sides of one seed, in fresh folders, the first side alternating with the seed."""
    runs: dict[str, Run] = {}
    for side in ("online", "offline") if seed % 2 == 0 else ("offline", "online"):
        config = config_for(args, seed, side, folder)
        run, model = (run_online if side == "online" else run_offline)(config, args)
        run.errors = judge(load_config(config), model, trajectories)
        runs[side] = run
        print(
            f"  seed {seed} {side:7s}: {run.simulations} simulations, {run.unique_steps} unique steps, "
            f"{run.batches} batches ({run.windows_trained} windows) in {run.training_s:.1f} s"
            + (" from launch" if side == "online" else "")
            + (f" after {run.generation_s:.1f} s of generation and loading" if side == "offline" else "")
            + "; rollout error "
            + ", ".join(f"{error:.4f} at {h}" for h, error in run.errors.items()),
            flush=True,
        )
    return runs["online"], runs["offline"]


def summarise(args: argparse.Namespace, pairs: list[tuple[Run, Run]]) -> str:
    """The RESULT line: the median over seeds of offline's end error over online's, and each side's medians."""
    ratios = [off.errors["end"] / on.errors["end"] for on, off in pairs]

    def median(side: int, key: str) -> float:
        return statistics.median(
            pair[side].errors[key] if key in HORIZONS else getattr(pair[side], key) for pair in pairs
        )

    sides = " ".join(
        f"{name}_end={median(i, 'end'):.4f} {name}_10={median(i, '10'):.4f} "
        f"{name}_simulations={median(i, 'simulations'):.0f} {name}_batches={median(i, 'batches'):.0f}"
        for i, name in enumerate(("online", "offline"))
    )
    memory_mb = args.ranks * args.capacity * len(FIELDS) * 64 * 64 * 4 / 1e6
    return (
        f"RESULT online_vs_offline_rollout ratio={statistics.median(ratios):.3f} target=1.16 {sides} "
        f"per_seed={','.join(f'{r:.3f}' for r in ratios)} seeds={len(pairs)} seconds={args.seconds:.0f} "
        f"ranks={args.ranks} capacity={args.capacity}steps memory={memory_mb:.1f}MB held_out={args.held_out}"
    )


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=90.0, help="wall-clock budget of each side")
    parser.add_argument("--capacity", type=int, default=150, help="steps per rank's Reservoir")
    parser.add_argument("--ranks", type=int, default=2, help="K, server ranks of the online side")
    parser.add_argument("--batch", type=int, default=16, help="windows per training step (batch / K per rank)")
    parser.add_argument("--lr", type=float, default=1e-3)
    parser.add_argument("--steps", type=int, default=50, help="time steps per simulation")
    parser.add_argument("--held-out", type=int, default=16, help="held-out trajectories")
    parser.add_argument("--offline", type=Path, help=argparse.SUPPRESS)  # the offline side's own process
    parser.add_argument("--model", type=Path, help=argparse.SUPPRESS)
    parser.add_argument("--report", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.offline is not None:
        return offline_main(args)
    with tempfile.TemporaryDirectory(prefix="melissa_online_vs_offline_rollout_") as tmp:
        trajectories = held_out(load_config(config_for(args, 0, "held-out", Path(tmp))), args.held_out)
        pairs = [run_seed(args, seed, Path(tmp), trajectories) for seed in range(args.seeds)]
    print(summarise(args, pairs))
    return 0


if __name__ == "__main__":
    sys.exit(main())
