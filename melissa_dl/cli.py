"""``melissa-server config.json``: check the study, then start this rank of the MPI server.

Everything that can be checked without MPI is checked here, before MPI or a
process group starts, so that ``--check`` costs none and a mistake is one
line and exit 2, not a traceback on K ranks that a supervisor restarts.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
from pathlib import Path

from launcher.schedulers import missing_program
from melissa_dl.config.sections import Config, load_config
from melissa_dl.errors import ConfigError
from melissa_dl.runtime.allocator import keep_freed_memory
from melissa_dl.runtime.files import check_writable
from melissa_dl.runtime.mpi import first_of_launch, keep_pmi_lines_short
from melissa_dl.runtime.status import EXIT_CONFIG
from melissa_dl.study.jobs import check_settings, scheduler_from_config
from melissa_dl.study.progress import show_status


def make_parser() -> argparse.ArgumentParser:
    """``melissa-server``'s options (also those of ``python -m melissa_dl``; the CLI reference is generated from
    them)."""
    parser = argparse.ArgumentParser(
        prog="melissa-server", description="Online-learning server for simulation ensembles."
    )
    parser.add_argument("config", nargs="?", help="the study's JSON configuration")
    _output_commands(parser)
    parser.add_argument(
        "--try-simulation",
        action="store_true",
        help="run one simulation (the first parameter set, or --parameters) against a throwaway local "
        "server, check what it sends against the study, print what arrived, and exit (1 on a problem)",
    )
    parser.add_argument(
        "--parameters",
        nargs="+",
        metavar="VALUE",
        help="with --try-simulation: the simulation's parameters (numbers; the configuration may follow them)",
    )
    parser.add_argument(
        "--check",
        action="store_true",
        help="check the configuration, that output_dir can be written, that the simulation's program "
        "exists and that the training module builds; print the configuration resolved, and exit",
    )
    parser.add_argument(
        "--fresh",
        action="store_true",
        help="start over: delete the checkpoints and TensorBoard logs of an earlier run instead of resuming",
    )
    parser.add_argument(
        "--export-model",
        action="store_true",
        help="write model.pt from the latest checkpoint (on any number of ranks) and exit",
    )
    return parser


def _output_commands(parser: argparse.ArgumentParser) -> None:
    """The options that act on a study's output folder instead of running one."""
    parser.add_argument(
        "--status",
        metavar="OUTPUT_DIR",
        type=Path,
        help="print the latest status of the study writing into OUTPUT_DIR (running or not), and exit",
    )
    parser.add_argument(
        "--plot",
        metavar="OUTPUT_DIR",
        type=Path,
        help="draw the PNGs of the study in OUTPUT_DIR (running or not) into that folder, and exit",
    )
    parser.add_argument(
        "--serve",
        metavar="OUTPUT_DIR",
        type=Path,
        help="answer predictions of the model a study wrote into OUTPUT_DIR on every rank, until stopped; "
        "clients (melissa_dl.Predictor) read OUTPUT_DIR/serving.json",
    )
    parser.add_argument(
        "--serve-port",
        metavar="PORT",
        type=int,
        default=0,
        help="with --serve: rank r binds PORT + r (default: free ports)",
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = make_parser()
    args = parser.parse_args(argv)
    _numbers_and_config(parser, args)
    if [args.config, args.status, args.plot, args.serve].count(None) != 3:
        parser.error("give a configuration file, --status OUTPUT_DIR, --plot OUTPUT_DIR or --serve OUTPUT_DIR")
    if not 0 <= args.serve_port < 1 << 16:
        parser.error(f"argument --serve-port: {args.serve_port} is not a port number")
    return args


def _numbers_and_config(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """``--parameters`` as numbers; in ``--parameters 160 3.0 config.json`` argparse took the configuration for a
    value: it is the configuration."""
    if args.parameters is None:
        return
    if args.config is None and len(args.parameters) > 1 and not _is_number(args.parameters[-1]):
        args.config = args.parameters.pop()
    if bad := [value for value in args.parameters if not _is_number(value)]:
        parser.error(f"argument --parameters: {bad[0]!r} is not a number")
    args.parameters = [float(value) for value in args.parameters]


def _is_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def check_study(config: Config, build: bool) -> None:
    """What a run needs besides a valid config; ``build``: also construct the training module (on the meta
    device, so that a large table costs no memory)."""
    check_settings(config)
    check_writable(config.output_path)
    if (problem := missing_program(config.launcher.command, config.base_dir)) is not None:
        raise ConfigError(f"launcher.command[0]: {problem}")
    if (refusal := scheduler_from_config(config).dry_run()) is not None:
        raise ConfigError(f"launcher.{config.launcher.scheduler}: {refusal}")
    training = config.training
    if training is None:
        return
    import torch  # only now: --help, --status and a config's parsing need none of it

    from melissa_dl.serving.online import check_servable
    from melissa_dl.train.module import check_options, check_prediction_inputs, load_module_class

    module_class = load_module_class(config.base_dir / training.module, training.class_name)
    check_options(module_class, training.options)
    if build:
        try:
            with torch.device("meta"):
                module = module_class(**training.options)
        except Exception as error:  # the user's constructor: whatever it raises is this config's error
            raise ConfigError(
                f"training: building {module_class.__name__}(**training.options) failed: "
                f"{type(error).__name__}: {error}"
            ) from error
        check_prediction_inputs(module)
        if config.serving.online:
            check_servable(module)


def main(argv: list[str] | None = None) -> int:
    try:
        return run(parse_args(argv))
    finally:
        # left to do: the interpreter's exit, whose collections would walk every object that torch made (about
        # 1 CPU-s of each rank's end); frozen, they are skipped, and what our code writes is closed already
        gc.freeze()


def run(args: argparse.Namespace) -> int:
    if args.status is not None:
        return print_status(args.status)
    if args.plot is not None:
        return plot(args.plot)
    if args.serve is not None:
        keep_pmi_lines_short()
        from melissa_dl.serving.standalone import serve_model  # only now: MPI

        return serve_model(args.serve, args.serve_port)
    keep_pmi_lines_short()  # before MPI_Init reads MPIR_CVAR_CH4_NETMOD (a training module may import mpi4py)
    try:
        config = load_config(args.config)
        check_study(config, build=args.check)
    except ConfigError as error:
        if first_of_launch():  # one line, not K
            sys.stderr.write(f"melissa-server: {args.config}: {error}\n")
        return EXIT_CONFIG
    if args.check:
        sys.stdout.write(json.dumps(config.to_dict(), indent=2) + "\n")  # stdout: a file of it is valid JSON
        sys.stderr.write(f"melissa-server: {args.config}: valid, {verdict(config)}; nothing was started\n")
        return 0
    if args.try_simulation:
        return try_one(config, args.parameters)
    keep_freed_memory()  # before MPI starts, so that an MPI library's own malloc options win
    from melissa_dl.server import serve  # only now: MPI and the training machinery

    return serve(config, fresh=args.fresh, export_model=args.export_model)


def verdict(config: Config) -> str:
    """What ``--check`` found valid, in a few words: the study's size, what trains, where it writes."""
    study, training = config.study, config.training
    steps = f" of {study.time_steps} steps" if study.time_steps is not None else ""
    trains = f"{training.class_name} trains on it" if training is not None else "nothing trains"
    return f"{study.all_simulations} simulations{steps}, {trains}, output in {config.output_path}"


def print_status(output: Path) -> int:
    try:
        sys.stdout.write(show_status(output) + "\n")
    except (OSError, ValueError, KeyError) as error:  # no file yet, or not one of ours
        sys.stderr.write(f"melissa-server: no status in {output} ({error}); has the server started there?\n")
        return EXIT_CONFIG
    return 0


def plot(output: Path) -> int:
    from melissa_dl.study.plots import draw  # matplotlib: only when asked

    try:
        paths = draw(output)
    except (OSError, ValueError, KeyError) as error:
        sys.stderr.write(f"melissa-server: nothing to plot in {output} ({error}); has the server started there?\n")
        return EXIT_CONFIG
    sys.stdout.write("".join(f"{path}\n" for path in paths))
    return 0


def try_one(config: Config, parameters: list[float] | None) -> int:
    from melissa_dl.study.trial import describe, try_simulation

    if parameters is not None and len(parameters) != len(config.study.parameters):
        sys.stderr.write(
            f"melissa-server: --parameters: {len(parameters)} values for the study's "
            f"{len(config.study.parameters)} parameters\n"
        )
        return EXIT_CONFIG
    trial = try_simulation(config, parameters)
    sys.stdout.write(describe(trial) + "\n")
    return 1 if trial.problems else 0
