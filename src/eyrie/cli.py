"""The `eyrie` command line: checks and previews around the Snakemake pipeline."""

from __future__ import annotations

import argparse
import sys

from eyrie.core.errors import EyrieError


def _plan(args) -> None:
    from eyrie import config as cfg
    from eyrie.plan import build_plan, format_plan

    table, summary = build_plan(cfg.load(args.config), args.directory)
    print(format_plan(table, summary))


def _check_config(args) -> None:
    from eyrie import config as cfg

    checked = cfg.load(args.config)
    print(f"{args.config}: valid ({len(checked['datasets'])} datasets, model {checked['model']['name']})")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="eyrie", description=__doc__)
    commands = parser.add_subparsers(dest="command", required=True)

    plan = commands.add_parser("plan", help="per shard: prompts done and left, tokens and hours left")
    plan.add_argument("--config", default="config.yaml")
    plan.add_argument("--directory", "-d", default=".", help="the pipeline's working directory")
    plan.set_defaults(run=_plan)

    check = commands.add_parser("check-config", help="validate a config against the schema")
    check.add_argument("--config", default="config.yaml")
    check.set_defaults(run=_check_config)

    args = parser.parse_args(argv)
    try:
        args.run(args)
    except EyrieError as err:
        print(f"eyrie: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
