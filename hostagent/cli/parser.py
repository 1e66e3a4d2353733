"""The `hostagent` argument parser and entry point: `build_parser` registers every command group, in the order
`hostagent --help` lists them (`REGISTER`, the one place that does), and `main` parses and dispatches. Nothing
else in hostagent.cli imports this module.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence
from typing import Any

from hostagent import __version__
from hostagent.cli import attach, bench, db, doctor, gpus, leases, model, probe, reaper, serve, tokens, topology, vfio
from hostagent.cli.common import EXIT_USAGE, run

# Every command group, in the order of `hostagent --help`.
REGISTER: tuple[Callable[[Any], None], ...] = (
    serve.register,  # serve, demo
    doctor.register,  # doctor
    gpus.register,  # gpus
    leases.register,  # leases, release, lease move
    gpus.register_actions,  # gpu clear
    tokens.register,  # token issue
    vfio.register,  # vfio bind|release
    attach.register,  # attach, detach
    reaper.register,  # reaper status|pause|resume
    db.register,  # db upgrade|status|export
    model.register,  # model train|evaluate|show|rollback|simulate
    topology.register,  # topology
    probe.register,  # probe
    bench.register,  # bench NAME
)


def build_parser() -> argparse.ArgumentParser:
    """The full argument parser."""
    parser = argparse.ArgumentParser(
        prog="hostagent",
        description="Lease whole GPUs to KVM/libvirt VMs over VFIO passthrough.",
        epilog="Exit status: 0 ok, 1 failed, 2 bad usage or configuration, 3 agent unreachable.",
    )
    parser.add_argument("--version", action="version", version=f"hostagent {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for register in REGISTER:
        register(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the `hostagent` console script."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:2] == ["model", "simulate"]:  # the simulator parses its own arguments (argparse cannot forward them)
        from hostagent.learn.simulate import main as simulate

        return simulate(argv[2:])
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return EXIT_USAGE
    return run(args)
