"""The `eyrie` command line: checks and previews around the Snakemake pipeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyrie.core.errors import EyrieError


def _plan(args) -> None:
    from eyrie import config as cfg
    from eyrie.plan import build_plan, format_cache, format_plan, format_synthesis

    config = cfg.load(args.config)
    synthesis = format_synthesis(config, args.directory)
    if synthesis:
        print(synthesis)
        print()
    table, summary = build_plan(config, args.directory)
    print(format_plan(table, summary))
    print()
    print(format_cache(config, args.directory))


def _check_config(args) -> None:
    from eyrie import config as cfg

    checked = cfg.load(args.config)
    print(f"{args.config}: valid ({len(checked['datasets'])} datasets, model {checked['model']['name']})")


def _verify(args) -> int:
    from eyrie import config as cfg
    from eyrie.verify import format_verification, verify_workspace

    config_path = args.config or str(Path(args.directory) / "config.yaml")
    result = verify_workspace(cfg.load(config_path), args.directory, config_path, quick=args.quick)
    print(format_verification(result))
    return 0 if result.ok else 1


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eyrie", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="per shard: prompts done and left, tokens and hours left; the hidden-state cache's size against the free disk")
    plan.add_argument("--config", default="config.yaml")
    plan.add_argument("--directory", "-d", default=".", help="the pipeline's working directory")
    plan.set_defaults(run=_plan)

    check = commands.add_parser("check-config", help="validate a config against the schema")
    check.add_argument("--config", default="config.yaml")
    check.set_defaults(run=_check_config)

    verify = commands.add_parser(
        "verify",
        help="every planned file: missing, corrupt (digest, readability) or stale, and the snakemake command that rebuilds them",
    )
    verify.add_argument("--config", default=None, help="default: config.yaml in the working directory")
    verify.add_argument("--directory", "-d", default=".", help="the pipeline's working directory")
    verify.add_argument("--quick", action="store_true", help="read headers and footers only, skip hashing every byte")
    verify.set_defaults(run=_verify)

    args = parser.parse_args(argv)
    try:
        return args.run(args) or 0
    except EyrieError as err:
        print(f"eyrie: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
