"""A tiny random target of each family the users serve, through the real Snakefile to report.html.

Each target (hidden 64, 8 layers, the default model's tokenizer and vocabulary; tiny_family_target) is built once per
module and named by model.path, its final norm scaled so that its next-token distributions are peaked as a trained
model's are (at random init they are flat to within a few hundredths of a nat of chance, and nothing learned can show).
A family's run is the smallest the pipeline makes whole: twelve short local prompts in one shard, the target
regenerating 24-token replies (its own greedy tokens make the draft vocabulary, so its argmax is in it), a 16-token
draft vocabulary, a few epochs of one-sample steps at a constant rate, and a one-prompt benchmark of a chain and one
small tree. What must hold for every family: the draft vocabulary is built over the text model's vocabulary, the
drafter's config.json is what SGLang builds a Llama draft layer from, training learns (the first draft step's loss
over the last epoch is clearly below ln(draft vocabulary), where a drafter that cannot learn stays), the benchmark ran
on the static engine and found the drafter's chain and tree identical to greedy decoding, and report.html is written.
"""

from __future__ import annotations

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from conftest import make_workdir, one_lean_benchmark, snakemake
from factories import FAMILIES, tiny_family_target

pytestmark = pytest.mark.e2e


class BenchmarkFails(AssertionError):
    """The family's benchmark (eyrie.decoding's engine) did not run, or not on the static engine: a family the engine
    cannot run yet is marked pytest.mark.xfail(strict=True, raises=BenchmarkFails, reason=<its error>)."""


EPOCHS = 4
LOGIT_SCALE = 8.0  # peaked targets (tiny_family_target): what the drafter learns is clearly below chance

# Short prompts: a sample (the template's default system turn, the prompt, the reply) fits one training batch whole.
# family-12 is the one held out (heldout_fraction 0.02), the benchmark's prompt.
PROMPTS = [{"id": f"family-{i}", "messages": [{"role": "user", "content": text}]} for i, text in enumerate(
    ["Name a colour.", "What is 2+2?", "Say hello.", "Count to five.", "Spell cat.", "Name a fruit.", "Name a month.",
     "What is 3+4?", "Say goodbye.", "Name a river.", "Spell dog.", "Name a planet."], start=1)]


def family_config(family: str, target_dir):
    def change(config):
        config["model"] = {"name": f"tiny-{family.replace('_', '-')}", "path": str(target_dir), "device": "cpu"}
        config["datasets"] = {"local": {**config["datasets"]["local"], "heldout_fraction": 0.02, "generation": {"max_new_tokens": 24}}}
        config["generation"].update(max_turns=1)
        config["drafter"].update(ttt_steps=2, draft_vocab_size=16)
        # One sample a step, at a constant rate from the first: a handful of steps under warmup and cosine decay barely move.
        config["train"].update(epochs=EPOCHS, batch_tokens=96, learning_rate=0.003, warmup_ratio=0.0, lr_schedule="constant")
        one_lean_benchmark(config)
        # One small tree: tree decoding over sliding-window layers is what these families need of the engine.
        config["bench"].update(max_new_tokens=8, draft_tokens=2, ngram=False, sweep=[{"steps": 2, "topk": 2, "draft_tokens": 4}])
    return change


@pytest.fixture(scope="module")
def family_runs(tmp_path_factory, shared_resources, model_dir):
    """{family: (workdir, snakemake's result, seconds)}: every family's target built once, then its run to report.html,
    two runs at a time on one core each (a run is a chain of short single-threaded jobs, mostly imports and loads)."""
    root = tmp_path_factory.mktemp("families")
    targets = {family: tiny_family_target(family, root / "targets" / family, model_dir, logit_scale=LOGIT_SCALE) for family in FAMILIES}

    def run(family):
        workdir = make_workdir(root / family, shared_resources, family_config(family, targets[family]), local_prompts=PROMPTS)
        start = time.monotonic()
        # --keep-going: the drafter is built even where the benchmark fails, so both are checked.
        done = snakemake(workdir, "report.html", "--keep-going", "--cores", "1", check=False)
        return workdir, done, time.monotonic() - start

    with ThreadPoolExecutor(2) as pool:
        return dict(zip(FAMILIES, pool.map(run, FAMILIES)))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_stage_runs_for_the_family_and_the_drafter_learns(family, family_runs):
    from eyrie.tokens.vocab import load_draft_vocab

    workdir, done, seconds = family_runs[family]
    print(f"{family}: {seconds:.0f} s to report.html")
    assert (workdir / "results/drafter/config.json").exists(), done.stderr[-6000:]  # every stage to the drafter: all families
    d2t, t2d, _ = load_draft_vocab(workdir / "results/vocab/draft_vocab.safetensors")
    assert t2d.numel() == 49152  # over the text model's vocabulary (a multimodal config has none at its top level)
    drafter = json.loads((workdir / "results/drafter/config.json").read_text())
    assert drafter["vocab_size"] == 49152 and drafter["draft_vocab_size"] == d2t.numel()
    assert drafter["hidden_act"] == "silu"  # what the draft layer computes; SGLang's LlamaMLP takes nothing else
    assert drafter["num_attention_heads"] % drafter["num_key_value_heads"] == 0
    log = json.loads((workdir / "results/drafter/training_log.json").read_text())
    first_step = [e["loss_per_step"][0] for e in log if "loss_per_step" in e]  # one entry a step (log_every 1)
    chance = math.log(drafter["draft_vocab_size"])
    # It learns: the first draft step's loss over the last epoch (each step one sample: the whole set once) is clearly
    # below chance, ln(draft vocabulary), and below the untrained drafter's at step 1, where a drafter whose norm
    # zeroes its head's input (Gemma's (1 + w) weight copied as w) stays at chance.
    per_epoch = len(first_step) // EPOCHS
    last_epoch = sum(first_step[-per_epoch:]) / per_epoch
    print(f"{family}: first-step loss {first_step[0]:.3f} at step 1, {last_epoch:.3f} over the last epoch; ln(V_draft) {chance:.3f}")
    assert per_epoch >= 8 and last_epoch < chance - 0.15 and last_epoch < first_step[0] - 0.3, (first_step, chance)

    bench_json, bench_log = workdir / "results/bench/local.json", workdir / "logs/bench/local.log"
    if not bench_json.exists():
        raise BenchmarkFails(f"{family}'s benchmark failed:\n{bench_log.read_text()[-4000:] if bench_log.exists() else done.stderr[-4000:]}")
    assert done.returncode == 0, done.stderr[-6000:]
    bench = json.loads(bench_json.read_text())
    if not bench["decoder"].startswith("static"):  # static, static-cudagraph, static-modules: eyrie.decoding's engine
        raise BenchmarkFails(f"{family} was benchmarked on {bench['decoder']!r}: {bench['decoder_fallback_reason']}")
    assert bench["lossless"] is True and [s["lossless"] for s in bench["sweep"]["settings"]] == [True], bench["sweep"]
    assert (workdir / "report.html").stat().st_size > 0
