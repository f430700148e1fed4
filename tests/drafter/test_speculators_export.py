"""The speculators-format export, proven by the engines' own code.

speculators 0.9.0 pins transformers <= 5.19 and eyrie runs on a newer one, so the proof runs in a venv of its
own, built from envs/speculators.yaml's pins on first use and cached (EYRIE_SPECULATORS_VENV, default
/tmp/eyrie-speculators-<hash of the pins>; EYRIE_SPECULATORS_PYTHON points at a ready interpreter instead).
Building it takes about a minute here (torch's CPU wheel comes from this machine's disk); the tests skip, saying
why, only when it cannot be built. In it tests/drafter/speculators_check.py loads the export with speculators'
Eagle3DraftModel and runs two training-time steps on token ids and aux states that eyrie's drafter (loaded by
eyrie.drafter.checkpoint.load_drafter, decoding step by step) has answered first: the draft logits must agree.
The same script reads both directories with vLLM 0.33.0's own config classes (cut out of its wheel, see
tests/target/engine_sources.py; vLLM's transformers range, 5.16.1-5.21, holds 5.19).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import runpy
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import yaml
from factories import tiny_llama
from safetensors.torch import load_file, save_file
from target.engine_sources import vllm_config_package

from eyrie.drafter.checkpoint import CheckpointError, checkpoint_tensors, load_drafter, write_checkpoint
from eyrie.drafter.model import DraftCache, DrafterShape, Eagle3Drafter
from eyrie.drafter.speculators_export import expected_tensors, export_dir_for, export_speculators
from eyrie.target.aux_layers import capture_indices

REPO = Path(__file__).resolve().parents[2]
CHECK_SCRIPT = Path(__file__).with_name("speculators_check.py")
# What `import speculators.models.eagle3` needs beside torch and transformers; speculators itself goes in without
# its dependencies, which include torchvision and torchaudio (GBs, and unused by the eagle3 classes).
IMPORT_DEPS = ["loguru==0.7.3", "pydantic-settings==2.16.3", "openai==3.57.0", "datasets==5.1.0", "hs-connectors==0.9.0"]
SEQUENCE = 128  # speculators' flex-attention masks extend in blocks of 128 positions
TOLERANCE = 2e-4  # relative to the largest logit: both sides compute in float32 from the same bfloat16 weights


def speculators_pins() -> dict[str, str]:
    spec = yaml.safe_load((REPO / "envs" / "speculators.yaml").read_text())
    pins = next(d for d in spec["dependencies"] if isinstance(d, dict))["pip"]
    return {line.split("==")[0]: line for line in pins}


def build_venv(venv: Path) -> None:
    """python -m venv, torch, speculators without its dependencies, then transformers and what the eagle3 classes import."""
    pins = speculators_pins()
    steps = [
        [sys.executable, "-m", "venv", str(venv)],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", pins["torch"]],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps", pins["speculators"]],
        [str(venv / "bin" / "python"), "-m", "pip", "install", "-q", pins["transformers"], *IMPORT_DEPS],
        [str(venv / "bin" / "python"), "-c", "import speculators.models.eagle3, transformers; print(transformers.__version__)"],
    ]
    for step in steps:
        done = subprocess.run(step, check=False, capture_output=True, text=True, timeout=1200)
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(step)} failed: {(done.stderr or done.stdout).strip()[-1500:]}")


@pytest.fixture(scope="session")
def speculators_python() -> str:
    """An interpreter with speculators 0.9.0, torch and transformers 5.19: EYRIE_SPECULATORS_PYTHON, or a cached venv."""
    if os.environ.get("EYRIE_SPECULATORS_PYTHON"):
        return os.environ["EYRIE_SPECULATORS_PYTHON"]
    key = hashlib.sha256(json.dumps([sorted(speculators_pins().values()), IMPORT_DEPS, sys.version_info[:2]]).encode()).hexdigest()[:12]
    venv = Path(os.environ.get("EYRIE_SPECULATORS_VENV") or f"/tmp/eyrie-speculators-{key}")
    ready = venv / ".eyrie-ready"
    venv.parent.mkdir(parents=True, exist_ok=True)
    with open(f"{venv}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # one build at a time; the others wait and reuse it
        if not ready.is_file():
            shutil.rmtree(venv, ignore_errors=True)  # a build that was killed halfway
            started = time.monotonic()
            try:
                build_venv(venv)
            except (RuntimeError, OSError, subprocess.TimeoutExpired) as err:
                pytest.skip(f"cannot build the speculators venv at {venv}: {err}")
            ready.write_text(f"built in {time.monotonic() - started:.0f} s\n")
    return str(venv / "bin" / "python")


# ---------------------------------------------------------------- drafters to export


def tiny_target(directory: Path, seed: int = 0):
    """A random 6-layer Llama saved as an HF directory (tied embeddings, like the default SmolLM2)."""
    return tiny_llama(directory, seed=seed, hidden=64, layers=6, vocab=300, intermediate=128, positions=512, head_dim=16, rope_theta=50000.0,
                      tie_word_embeddings=True)


def random_drafter(target, draft_vocab_size: int, aux_layer_ids, seed: int, **flags) -> Eagle3Drafter:
    """A drafter of the target's shape with random weights, norms included (all-ones norms would hide a swapped one)."""
    torch.manual_seed(seed)
    config = target.config
    shape = DrafterShape.from_target(config, draft_vocab_size, aux_layer_ids, **flags)
    keep = torch.randperm(config.vocab_size)[:draft_vocab_size].sort().values
    t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
    t2d[keep] = True
    drafter = Eagle3Drafter(shape, target.get_input_embeddings().weight.detach().float(), keep - torch.arange(draft_vocab_size), t2d)
    with torch.no_grad():
        for parameter in drafter.parameters():
            if parameter.dim() == 1:
                parameter.copy_(1 + 0.5 * torch.randn_like(parameter))
            else:
                parameter.normal_(0, 0.5 / parameter.shape[-1] ** 0.5)
    return drafter


def write_drafter(drafter: Eagle3Drafter, directory: Path) -> Path:
    """Through the training job's own writer: config.json as SGLang's layout completed for vLLM, bf16 weights."""
    write_checkpoint(directory, drafter.shape.sglang_config(), checkpoint_tensors(drafter), [])
    return directory


def eyrie_logits(drafter: Eagle3Drafter, input_ids: torch.Tensor, aux: torch.Tensor, positions: torch.Tensor) -> dict[str, torch.Tensor]:
    """eyrie's draft logits for the two steps speculators' forward runs (ttt_steps=2), decoded as serving does.

    Step 0 at position t reads the aux state and token t; step 1 at t reads step 0's output at t and token t + 1
    (0 past the end, as speculators pads), at position + 1, attending to step 0's keys up to t and to itself.
    """
    with torch.no_grad():
        hidden = drafter.project_aux(aux)
        step0, _ = drafter.decode(hidden, input_ids, positions, DraftCache())
        next_ids = torch.cat([input_ids[:, 1:], torch.zeros_like(input_ids[:, :1])], dim=1)
        step1 = []
        for t in range(input_ids.shape[1]):
            cache = DraftCache()
            _, carried = drafter.decode(hidden[:, : t + 1], input_ids[:, : t + 1], positions[:, : t + 1], cache)
            logits, _ = drafter.decode(carried[:, t : t + 1], next_ids[:, t : t + 1], positions[:, t : t + 1] + 1, cache)
            step1.append(logits)
    return {"step0": step0, "step1": torch.cat(step1, dim=1)}


# ---------------------------------------------------------------- the export on its own


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    root = tmp_path_factory.mktemp("tiny")
    target = tiny_target(root / "target")
    drafter = write_drafter(random_drafter(target, 100, [1, 2, 4], seed=1), root / "drafter")
    export = export_dir_for(drafter)
    config = export_speculators(drafter, root / "target", export, speculative_tokens=4)
    return {"root": root, "target": target, "drafter": drafter, "export": export, "config": config}


def test_export_has_the_fields_vllm_and_speculators_read(tiny):
    config = json.loads((tiny["export"] / "config.json").read_text())
    assert config == tiny["config"]
    assert config["speculators_model_type"] == "eagle3" and config["architectures"] == ["Eagle3Speculator"]
    assert config["norm_before_residual"] is False  # vLLM reads an absent one as true
    assert (config["norm_before_fc"], config["fc_norm"], config["norm_output"]) == (False, False, False)
    assert config["eagle_aux_hidden_state_layer_ids"] == capture_indices([1, 2, 4], 6) == [2, 3, 5]  # vLLM's convention
    assert config["draft_vocab_size"] == 100 and config["target_hidden_size"] == 64
    layer = config["transformer_layer_config"]
    assert layer["model_type"] == "llama" and layer["num_hidden_layers"] == 1 and layer["vocab_size"] == 300
    assert layer["hidden_act"] == "silu" and layer["head_dim"] == 16 and layer["rope_parameters"]["rope_theta"] == 50000.0
    proposal = config["speculators_config"]["proposal_methods"][0]
    assert proposal["proposal_type"] == "greedy" and proposal["speculative_tokens"] == 4
    assert config["speculators_config"]["verifier"] == {"name_or_path": str(tiny["root"] / "target"), "architectures": ["LlamaForCausalLM"]}


def test_export_tensors_are_the_drafters_renamed_plus_the_targets_embeddings(tiny):
    drafter = load_file(str(tiny["drafter"] / "model.safetensors"))
    exported = load_file(str(tiny["export"] / "model.safetensors"))
    shape = DrafterShape.from_sglang_config(json.loads((tiny["drafter"] / "config.json").read_text()))
    assert set(exported) == set(expected_tensors(shape))
    assert not [k for k in exported if k.startswith("midlayer.")] and "layers.0.self_attn.q_proj.weight" in exported
    for name, tensor in drafter.items():
        assert torch.equal(exported[name.replace("midlayer.", "layers.0.")], tensor), name
    embeddings = tiny["target"].get_input_embeddings().weight.detach()
    assert torch.equal(exported["embed_tokens.weight"], embeddings.to(torch.bfloat16))


def test_every_file_is_readable_by_others(tiny):
    for directory in (tiny["drafter"], tiny["export"]):
        assert stat.S_IMODE(directory.stat().st_mode) == 0o755
        for path in directory.iterdir():
            assert stat.S_IMODE(path.stat().st_mode) == 0o644, path


def test_a_hub_id_as_served_name_is_the_verifier_as_written(tiny, tmp_path, monkeypatch):
    """model.served_name as a recipe sets it (a hub id) goes through the pipeline's export script into
    speculators_config.verifier unchanged: `vllm serve <export>` resolves it on the hub, so it is never made a path."""
    from eyrie import config as cfg

    config = cfg.load(str(REPO / "configs" / "qwen3-8b.yaml"))
    config["model"]["path"] = str(tiny["root"] / "target")
    assert config["model"]["served_name"] == "Qwen/Qwen3-8B"
    monkeypatch.chdir(tmp_path)
    snakemake = SimpleNamespace(  # what rules/speculators.smk hands the script
        input=SimpleNamespace(drafter=str(tiny["drafter"]), model=config["model"]["path"]),
        output=[str(tmp_path / "results" / "drafter-speculators")],
        params=SimpleNamespace(speculative_tokens=config["bench"]["draft_tokens"], served_name=config["model"].get("served_name")),
        log=[str(tmp_path / "logs" / "drafter" / "speculators.log")],
        config=config,
    )
    runpy.run_path(str(REPO / "scripts" / "export_speculators.py"), init_globals={"snakemake": snakemake})
    written = json.loads((tmp_path / "results" / "drafter-speculators" / "config.json").read_text())
    assert written["speculators_config"]["verifier"] == {"name_or_path": "Qwen/Qwen3-8B", "architectures": ["LlamaForCausalLM"]}


def test_export_refuses_another_targets_embeddings(tiny, tmp_path):
    tiny_llama(tmp_path / "other", seed=None, hidden=64, layers=6, vocab=301, intermediate=128, positions=2048, head_dim=16)
    with pytest.raises(CheckpointError, match="the drafter's own target"):
        export_speculators(tiny["drafter"], tmp_path / "other", tmp_path / "export", speculative_tokens=4)
    assert not (tmp_path / "export").exists()


# ---------------------------------------------------------------- proof by speculators' and vLLM's own code


@pytest.fixture(scope="module")
def proof(tmp_path_factory, model_dir, speculators_python):
    """Three exports (a tiny target; the same with the EAGLE-3.1 norms; the default target, SmolLM2-135M), each read by
    speculators and vLLM in one run of speculators_check.py; eyrie's logits computed here beforehand."""
    root = tmp_path_factory.mktemp("proof")
    tiny_model = tiny_target(root / "tiny-target")
    from eyrie.target.model import load_target

    smol, _ = load_target(model_dir, dtype="float32", device="cpu")
    cases, expected = [], {}
    for name, target, target_dir, aux_ids, flags in (
        ("tiny", tiny_model, root / "tiny-target", [1, 2, 4], {}),
        ("tiny-eagle3.1-norms", tiny_model, root / "tiny-target", [1, 2, 4], {"norm_before_fc": True, "norm_output": True}),
        ("smollm2", smol, Path(model_dir), [1, 14, 26], {}),
    ):
        drafter_dir = write_drafter(random_drafter(target, 64 if name != "smollm2" else 2048, aux_ids, seed=len(cases) + 7, **flags), root / name / "drafter")
        export = export_dir_for(drafter_dir)
        export_speculators(drafter_dir, target_dir, export, speculative_tokens=3)
        torch.manual_seed(len(cases))
        input_ids = torch.randint(0, target.config.vocab_size, (1, SEQUENCE))
        with torch.no_grad():  # the aux states the target itself produces for these ids, at eyrie's capture indices
            states = target(input_ids=input_ids, output_hidden_states=True).hidden_states
        aux = torch.cat([states[c] for c in capture_indices(aux_ids, target.config.num_hidden_layers)], dim=-1).float()
        positions = torch.arange(SEQUENCE)[None]
        # The export carries the target's embeddings in the drafter's weight dtype (bfloat16): eyrie's side reads the same.
        embeddings = load_file(str(export / "model.safetensors"))["embed_tokens.weight"].float()
        assert torch.equal(embeddings, target.get_input_embeddings().weight.detach().to(torch.bfloat16).float())
        ours = load_drafter(drafter_dir, embeddings)
        expected[name] = eyrie_logits(ours, input_ids, aux, positions)
        save_file({"input_ids": input_ids, "aux": aux.contiguous(), "positions": positions}, str(root / name / "inputs.safetensors"))
        cases.append({"name": name, "export": str(export), "drafter": str(drafter_dir), "inputs": str(root / name / "inputs.safetensors"),
                      "out": str(root / name / "speculators.safetensors"), "aux_layer_ids": aux_ids, "flags": flags})
    job = root / "job.json"
    job.write_text(json.dumps({"cases": cases, "vllm_root": str(vllm_config_package(root / "vllm-src"))}))
    done = subprocess.run([speculators_python, str(CHECK_SCRIPT), str(job)], check=False, capture_output=True, text=True, timeout=900,
                          env={**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "PYTHONPATH": ""})
    assert done.returncode == 0, done.stderr[-6000:]
    report = json.loads(done.stdout.strip().splitlines()[-1])
    return {"cases": {c["name"]: c for c in cases}, "expected": expected, "report": report}


CASES = ["tiny", "tiny-eagle3.1-norms", "smollm2"]


@pytest.mark.parametrize("name", CASES)
def test_speculators_loads_the_export_whole(proof, name):
    loaded = proof["report"]["cases"][name]["speculators"]
    assert proof["report"]["versions"]["speculators"] == "0.9.0"
    assert loaded["class"] == "Eagle3DraftModel" and loaded["config_class"] == "Eagle3SpeculatorConfig"
    assert loaded["missing_from_model"] == [] and loaded["differ_from_export"] == [] and loaded["nan"] == []
    # Only the verifier's own tensors (training targets) are not in the export: speculators copies them from the target.
    assert loaded["not_in_export"] == ["verifier_lm_head.weight", "verifier_norm.weight"]
    assert loaded["log"] == []
    assert loaded["norm_before_residual"] is False
    assert loaded["target_layer_ids"] == [i + 1 for i in proof["cases"][name]["aux_layer_ids"]]


@pytest.mark.parametrize("name", CASES)
def test_speculators_drafts_the_same_logits_as_eyrie(proof, name):
    theirs = load_file(proof["cases"][name]["out"])
    for step in ("step0", "step1"):
        ours = proof["expected"][name][step]
        assert theirs[step].shape == ours.shape
        difference = (theirs[step] - ours).abs().max().item()
        scale = ours.abs().max().item()
        agree = (theirs[step].argmax(-1) == ours.argmax(-1)).float().mean().item()
        print(f"{name} {step}: max |logit difference| {difference:.2e} (logits up to {scale:.2f}), argmax agrees at {agree:.1%}")
        assert difference <= TOLERANCE * max(1.0, scale), f"{name} {step}: max |logit difference| {difference} (logits up to {scale})"
        assert agree == 1.0


@pytest.mark.parametrize("name", CASES)
def test_vllm_reads_both_directories_as_trained(proof, name):
    case, read = proof["cases"][name], proof["report"]["cases"][name]["vllm"]
    capture = [i + 1 for i in case["aux_layer_ids"]]
    norm_before_fc, norm_output = bool(case["flags"].get("norm_before_fc")), bool(case["flags"].get("norm_output"))
    assert read["speculative_config"] == {"method": "eagle3", "num_speculative_tokens": 3}
    # `vllm serve <export>`: the speculators format, through vLLM's SpeculatorsConfig.
    spec = read["speculators_format"]
    assert spec["architectures"] == ["Eagle3LlamaForCausalLM"] and spec["eagle_aux_hidden_state_layer_ids"] == capture
    assert (spec["norm_before_residual"], spec["norm_before_fc"], spec["fc_norm"], spec["norm_output"]) == (False, norm_before_fc, False, norm_output)
    assert spec["hidden_act"] == "silu" and spec["num_hidden_layers"] == 1
    # `--speculative-config '{"method": "eagle3", "model": <results/drafter>}'`: the SGLang layout, through vLLM's EAGLEConfig.
    layout = read["sglang_layout"]
    assert layout["architectures"] == ["LlamaForCausalLMEagle3"] and layout["eagle_aux_hidden_state_layer_ids"] == capture
    assert (layout["norm_before_residual"], layout["norm_before_fc"], layout["norm_output"]) == (False, norm_before_fc, norm_output)
    assert layout["hidden_act"] == "silu"
