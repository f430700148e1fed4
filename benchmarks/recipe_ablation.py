"""The training recipe, setting by setting: drafters trained side by side on one pipeline run's cache, compared by
simulated acceptance on the same held-out cache samples.

Given a pipeline working directory (its config.yaml, results/hidden/, results/vocab/ and the target model), each
setting is the run's own drafter and train sections with a few keys changed, trained in this process by the
pipeline's own entry point (eyrie.training.train.train_drafter) on the same shards in the same order. Training
holds the same samples out (train.eval_fraction, by sample id) and simulates acceptance on them at every epoch's
end, so the settings are compared on what none of them trained on. Prints one row per setting: the simulated
acceptance length per chain length k of the written drafter (the kept epoch under train.keep_best), the best and
the last epoch's length at the longest k, and the training time; then the same as a Markdown table for
docs/PERFORMANCE.md.

    python benchmarks/recipe_ablation.py run/                         # the default settings below
    python benchmarks/recipe_ablation.py run/ --setting noise=train.hidden_noise=0.05 \\
        --setting norms=drafter.norm_before_fc=true,drafter.norm_output=true --set train.epochs=6 --out ablation.json

A setting is NAME=KEY=VALUE[,KEY=VALUE...] (KEY is section.key; VALUE is YAML); --set changes every setting
(the baseline included). A setting of drafter.draft_vocab_size trains on the vocabulary the pipeline would build at
that size, chosen from the counts results/vocab stores (eyrie.tokens.build_vocab.resize_draft_vocab).
The drafters go to a temporary directory (--keep DIR keeps them).

Settings are judged by the walked chain of --k drafts over the held-out samples' first replies: it replays the
decoder's rounds, and on the same tokens matches served acceptance to a few tenths of a percent
(benchmarks/drafter_probe.py parity); on the cache's held-out samples it has read 14-16% above the benchmarks' prompts, a bias
shared by every setting. --gpus 0,1,... trains one setting per GPU at once, each in its own process (several on one
GPU do not help: it time-slices them). --limit keeps a run inside a time-limited job: a setting that cannot finish in
time is not started. --overlay FILE writes the best setting's changes as a config overlay for the pipeline
(`snakemake --configfile config.yaml FILE`); benchmarks/h200/ablate.sh runs it all on the GPU machine.
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

# Knobs not yet measured on the GPU (the learning rate, argmax labels and a 3x MLP were: only the rate moved the walk;
# so was train.copy_weight 2, which did not pay); most promising first, as a cut run judges those it finished. The prompts' tokens first: they are cached and
# run through the drafter anyway (about a third as many tokens as the replies), and untrained on.
DEFAULT_SETTINGS = [
    "baseline=",
    "prompts-1=train.prompt_label_weight=1",
    "prompts-0.3=train.prompt_label_weight=0.3",
    "noise-0.05=train.hidden_noise=0.05",
    "vocab-16k=drafter.draft_vocab_size=16000",
    "both-norms=drafter.norm_before_fc=true,drafter.norm_output=true",
    "decay-0.6=drafter.step_weight_decay=0.6",
    "noise-0.2=train.hidden_noise=0.2",
    "lr-4e-3=train.learning_rate=0.004",
    "lr-constant=train.lr_schedule=constant",
    "ttt-5=drafter.ttt_steps=5",
]


def parse_changes(text: str) -> dict[tuple[str, str], object]:
    """'train.epochs=6,drafter.norm_output=true' -> {('train', 'epochs'): 6, ('drafter', 'norm_output'): True}."""
    changes = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = item.partition("=")
        section, dot, name = key.partition(".")
        if not sep or not dot or section not in ("train", "drafter"):
            raise SystemExit(f"cannot read {item!r}: expected train.KEY=VALUE or drafter.KEY=VALUE")
        changes[(section, name)] = yaml.safe_load(value)
    return changes


def parse_setting(text: str) -> tuple[str, dict]:
    name, sep, changes = text.partition("=")
    if not sep or not name:
        raise SystemExit(f"cannot read setting {text!r}: expected NAME=KEY=VALUE[,KEY=VALUE...] (or NAME= for no change)")
    return name, parse_changes(changes)


def pipeline_inputs(workdir: Path) -> dict:
    """What the pipeline's train job passes train_drafter (scripts/train_drafter.py), read from the working directory."""
    from eyrie.config import load, shard_names
    from eyrie.target.model import load_tokenizer, model_fingerprint, template_fingerprint

    config = load(workdir / "config.yaml")
    model = Path(config["model"]["path"] or f"resources/models/{config['model']['name']}")
    model = model if model.is_absolute() else workdir / model
    hidden = [workdir / "results" / "hidden" / dataset / f"{shard}.safetensors"
              for dataset in sorted(config["datasets"]) for shard in shard_names(config, dataset)]  # the rule's order
    vocab = workdir / "results" / "vocab" / "draft_vocab.safetensors"
    missing = [str(p) for p in [*hidden, vocab, model] if not p.exists()]
    if missing:
        raise SystemExit(f"{workdir}: not built yet ({len(missing)} missing, e.g. {missing[0]}); run the pipeline up to results/drafter first")
    tokenizer = load_tokenizer(model, config["model"]["trust_remote_code"])
    return {
        "hidden_paths": [str(p) for p in hidden],
        "vocab_path": str(vocab),
        "target_dir": str(model),
        "drafter_cfg": dict(config["drafter"]),
        "train_cfg": dict(config["train"]),
        "template_sha256": template_fingerprint(tokenizer),
        "target_fingerprint": model_fingerprint(model),
    }


def train_setting(name: str, changes: dict, inputs: dict, directory: Path, progress: bool) -> dict:
    """One drafter trained with these changes; its figures from the summary and the training log."""
    from eyrie.training.keep_best import acceptance_score
    from eyrie.training.train import train_drafter

    drafter_cfg, train_cfg = dict(inputs["drafter_cfg"]), dict(inputs["train_cfg"])
    for (section, key), value in changes.items():
        (drafter_cfg if section == "drafter" else train_cfg)[key] = value
    out = directory / name
    vocab_path = inputs["vocab_path"]
    if ("drafter", "draft_vocab_size") in changes:  # the vocabulary the pipeline would build at that size, from the run's counts
        from eyrie.tokens.build_vocab import resize_draft_vocab

        vocab_path = str(directory / f"{name}.vocab.safetensors")
        resize_draft_vocab(inputs["vocab_path"], int(changes[("drafter", "draft_vocab_size")]), vocab_path)
    t0 = time.perf_counter()
    summary = train_drafter(
        hidden_paths=inputs["hidden_paths"], vocab_path=vocab_path, target_dir=inputs["target_dir"],
        out_dir=str(out), state_dir=str(directory / f"{name}.state"), drafter_cfg=drafter_cfg, train_cfg=train_cfg,
        template_sha256=inputs["template_sha256"], target_fingerprint=inputs["target_fingerprint"], progress=progress,
    )
    seconds = time.perf_counter() - t0
    log = json.loads((out / "training_log.json").read_text())
    epochs = [e for entry in log for e in entry.get("eval", [])]
    scores = [acceptance_score(e) for e in epochs]
    written = summary["simulated_acceptance"]
    return {
        "k": written["k"],
        "length": written["length"],  # the written drafter's, per k
        "conditional_length": written.get("conditional_length"),
        "walked_length": written.get("walked_length"),  # the decoder's rounds replayed on held-out tokens: what serving measures
        "walked_first_turn_length": written.get("walked_first_turn_length"),  # the same over first replies (the benchmarks' prompts)
        "copy": written.get("copy"),  # where prompt lookup would copy: the drafter's accepted drafts beside prompt lookup's
        "source": f"{written['eval_samples']} {written['source']}",
        "kept_epoch": summary["kept"]["epoch"],
        "per_epoch_length": [None if s is None else s[1] for s in scores],  # at the longest measured k
        "best_length": max((s[1] for s in scores if s is not None), default=None),
        "last_length": None if scores[-1] is None else scores[-1][1],
        "final_loss": summary["final_loss"],
        "steps": summary["steps"],
        "tokens_per_second": summary["tokens_per_second"],
        "seconds": seconds,
    }


def _number(value, digits=3) -> str:
    return "n/a" if value is None else f"{value:.{digits}f}"


def served_score(row: dict, k: int) -> float | None:
    """What a setting is judged by: the walked chain of k drafts over held-out first replies (what a benchmark of first
    user turns serves; eyrie.drafter.checkpoint.first_turn_prediction), else over every turn."""
    for key in ("walked_first_turn_length", "walked_length"):
        values = row.get(key)
        if values and k in row["k"] and values[row["k"].index(k)] is not None:
            return float(values[row["k"].index(k)])
    return None


def copy_cell(copy: dict | None) -> str:
    """The copy slice (eyrie.training.acceptance): accepted drafts per round where prompt lookup would copy, the drafter's
    at its longest chain against prompt lookup's."""
    if not copy or not copy.get("positions"):
        return "n/a"
    return f"{_number(copy['drafter_accepted'][-1], 2)} / {_number(copy['lookup_accepted'], 2)} ({copy['positions']})"


def markdown(rows: list[dict], k: int) -> str:
    top = max(len(r["k"]) for r in rows)
    head = ("| setting | changes | " + " | ".join(f"k={i}" for i in range(1, top + 1))
            + f" | walked k={k} | first turn k={k} | copy slice, drafter / lookup | kept epoch | best | last | tok/s | s |")
    lines = [head, "|" + "---|" * (top + 10)]
    for r in rows:
        lengths = [_number(v) for v in r["length"]] + [""] * (top - len(r["length"]))
        at = r["k"].index(k) if k in r["k"] else None
        walked = [_number(None if at is None or not r.get(key) else r[key][at]) for key in ("walked_length", "walked_first_turn_length")]
        changes = ", ".join(f"`{key}: {json.dumps(value)}`" for key, value in r["changes"].items()) or "(the run's config)"
        lines.append(f"| {r['setting']} | {changes} | " + " | ".join(lengths) + " | " + " | ".join(walked) + f" | {copy_cell(r.get('copy'))}"
                     + f" | {r['kept_epoch']:g} | {_number(r['best_length'])} | {_number(r['last_length'])}"
                     + f" | {r['tokens_per_second']:.0f} | {r['seconds']:.0f} |")
    return "\n".join(lines)


def write_overlay(rows: list[dict], k: int, path: Path) -> dict | None:
    """The best setting's changes (by served_score) as a config overlay: Snakemake's --configfile merges its drafter and
    train sections over the run's config, so only training and what follows it rerun. None (nothing written) when no
    setting has a walked acceptance at k (k beyond drafter.ttt_steps)."""
    scored = [(served_score(r, k), r) for r in rows if served_score(r, k) is not None]
    if not scored:
        return None
    score, best = max(scored, key=lambda pair: pair[0])
    overlay: dict = {}
    for key, value in best["changes"].items():  # not --set's: those shape the ablation (e.g. fewer epochs), not the recipe
        section, name = key.split(".", 1)
        overlay.setdefault(section, {})[name] = value
    baseline = next((r for r in rows if not r["changes"]), None)
    note = (f"# recipe_ablation.py: {best['setting']} scored {score:.3f} (walked chain, k = {k}, held-out first replies)"
            + (f", the run's config {served_score(baseline, k):.3f}" if baseline and served_score(baseline, k) is not None else "") + "\n")
    path.write_text(note + (yaml.safe_dump(overlay, sort_keys=True) if overlay else "{}\n"))
    return {"setting": best["setting"], "score": score, "overlay": overlay}


def run_children(args, settings: list[tuple[str, dict]], directory: Path, save) -> list[dict]:
    """Each setting in its own process on its own GPU (--gpus), as many at once as there are GPUs; a setting still
    training at --limit is stopped and not judged, a setting that fails is reported, not fatal. Not several per GPU:
    on one H200, six settings trained at once ran slower in all than one alone (docs/PERFORMANCE.md)."""
    rows: dict[str, dict] = {}
    deadline = None if args.limit is None else time.monotonic() + args.limit
    free: queue.Queue = queue.Queue()
    for gpu in args.gpus.split(","):
        free.put(gpu.strip())

    def child(name: str, text: str) -> None:
        gpu = free.get()
        out, log = directory / f"{name}.row.json", directory / f"{name}.log"
        command = [sys.executable, __file__, str(args.workdir), "--setting", text, "--keep", str(directory), "--out", str(out)]
        if args.set:
            command += ["--set", args.set]
        try:
            with open(log, "w") as handle:
                left = None if deadline is None else max(1.0, deadline - time.monotonic())
                code = subprocess.run(command, check=False, stdout=handle, stderr=subprocess.STDOUT, timeout=left,
                                      env={**os.environ, "CUDA_VISIBLE_DEVICES": gpu}).returncode
        except subprocess.TimeoutExpired:  # run() has killed it
            print(f"{name}: stopped at --limit {args.limit:g} s, not judged; see {log}", flush=True)
            return
        finally:
            free.put(gpu)
        if code == 0 and out.exists():
            rows[name] = json.loads(out.read_text())[0]
            save([rows[n] for n, _ in settings if n in rows])
            print(f"{name}: done on GPU {gpu}, {_number(served_score(rows[name], args.k))} walked at k = {args.k} ({log})", flush=True)
        else:
            print(f"{name}: FAILED (exit {code}); see {log}", flush=True)

    texts = args.setting or DEFAULT_SETTINGS
    with ThreadPoolExecutor(max_workers=free.qsize()) as pool:
        for future in [pool.submit(child, name, text) for (name, _), text in zip(settings, texts)]:
            future.result()
    return [rows[name] for name, _ in settings if name in rows]


def run_here(args, settings: list[tuple[str, dict]], common: dict, inputs: dict, directory: Path, save) -> list[dict]:
    """The settings one after another in this process. With --limit, a setting is not started once the time left is
    shorter than the longest one so far took (so a run cut by its limit still judges what it finished)."""
    rows: list[dict] = []
    t0, longest = time.monotonic(), 0.0
    for name, changes in settings:
        if args.limit is not None and rows and time.monotonic() - t0 + longest > args.limit:
            print(f"{name}: not started: {args.limit - (time.monotonic() - t0):.0f} s of --limit left, a setting took {longest:.0f} s", flush=True)
            continue
        described = ", ".join(f"{section}.{key}={value}" for (section, key), value in changes.items()) or "the run's config"
        print(f"== {name}: {described}", file=sys.stderr, flush=True)
        row = train_setting(name, {**common, **changes}, inputs, directory, progress=not args.quiet)
        longest = max(longest, row["seconds"])
        rows.append({"setting": name, "changes": {f"{section}.{key}": value for (section, key), value in changes.items()},
                     "every_setting": {f"{section}.{key}": value for (section, key), value in common.items()}, **row})
        save(rows)
        print(f"{name}: simulated acceptance {' '.join(_number(v, 2) for v in row['length'])} (k=1..{len(row['k'])}) on {row['source']}; "
              f"walked at k = {args.k}: {_number(served_score(rows[-1], args.k))}; "
              f"kept epoch {row['kept_epoch']:g}, best {_number(row['best_length'])}, last {_number(row['last_length'])}; "
              f"{row['tokens_per_second']:.0f} tok/s, {row['seconds']:.0f} s", flush=True)
    return rows


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("workdir", type=Path, help="a pipeline working directory with config.yaml, results/hidden and results/vocab")
    parser.add_argument("--setting", action="append", help="NAME=KEY=VALUE[,KEY=VALUE...]; repeat; default: " + "; ".join(DEFAULT_SETTINGS))
    parser.add_argument("--set", default="", help="KEY=VALUE[,...] applied to every setting, e.g. train.epochs=6,train.device=cuda")
    parser.add_argument("--keep", type=Path, help="write the drafters here (kept) instead of a temporary directory")
    parser.add_argument("--out", type=Path, help="also write the rows as JSON here (rewritten as each setting ends)")
    parser.add_argument("--quiet", action="store_true", help="no training progress lines")
    parser.add_argument("--gpus", help="e.g. 0,1: each setting in its own process on one of these GPUs, as many at once as listed "
                                       "(default: one after another in this process)")
    parser.add_argument("--limit", type=float, help="seconds: settings that cannot finish in time are not started (--gpus: are stopped)")
    parser.add_argument("--k", type=int, default=4, help="the chain length settings are judged at (the served bench.draft_tokens; default 4)")
    parser.add_argument("--overlay", type=Path, help="write the best setting's changes here as a config overlay (snakemake --configfile)")
    args = parser.parse_args()

    common = parse_changes(args.set)
    settings = [parse_setting(text) for text in (args.setting or DEFAULT_SETTINGS)]
    if len({name for name, _ in settings}) != len(settings):
        raise SystemExit("setting names must differ")
    inputs = pipeline_inputs(args.workdir.resolve())

    def save(rows: list[dict]) -> None:  # after every setting: a run cut short keeps what it finished
        if args.out:
            args.out.write_text(json.dumps(rows, indent=1))
        if args.overlay and rows:
            write_overlay(rows, args.k, args.overlay)

    with tempfile.TemporaryDirectory(prefix="recipe-ablation-") as scratch:
        directory = args.keep or Path(scratch)
        directory.mkdir(parents=True, exist_ok=True)
        if args.gpus and len(settings) > 1:
            rows = run_children(args, settings, directory, save)
        else:
            rows = run_here(args, settings, common, inputs, directory, save)
    if not rows:
        raise SystemExit("no setting finished")
    print()
    if common:
        print("Every setting: " + ", ".join(f"`{section}.{key}: {json.dumps(value)}`" for (section, key), value in common.items()))
        print()
    print(markdown(rows, args.k))
    if args.overlay:
        picked = write_overlay(rows, args.k, args.overlay)
        print(f"\nbest: {picked['setting']} ({picked['score']:.3f} walked at k = {args.k}); overlay written to {args.overlay}" if picked
              else f"\nno setting has a walked acceptance at k = {args.k} (beyond drafter.ttt_steps?): no overlay written")
    return 0


if __name__ == "__main__":
    sys.exit(main())
