"""The drafter artifact: the directory SGLang loads with --speculative-draft-model-path.

config.json (DrafterShape.sglang_config plus eyrie's block), model.safetensors (exactly the tensors
SGLang loads: no embeddings, d2t as offsets, t2d as a mask) and training_log.json. Every key and
shape is checked before writing and after reading: SGLang skips unknown names silently.

One directory serves both engines (`serving_config`, docs/DESIGN.md "Aux layers"): SGLang reads the
nested ``eagle_config.eagle_aux_hidden_state_layer_ids`` (its ids, +1 added), vLLM the top-level
``eagle_aux_hidden_state_layer_ids`` (its own convention: the capture indices, used as they are; its
V2 runner never looks at the nested key). ``norm_before_residual`` is written false (vLLM's speculators
reading defaults it to true), the EAGLE-3.1 flags as trained, ``hidden_act`` silu (the drafter's MLP
is SiLU whatever the target uses). Every file is written 0644: a server under another account reads it.

Every file records its content digest (eyrie.core.digest): config.json and model.safetensors in
their own metadata, training_log.json (a JSON list) in config.json's ``eyrie.files``. load_drafter
checks them all, and check_checkpoint refuses NaN or infinite weights as it refuses a wrong shape.

config.json's ``eyrie.simulated_acceptance`` is training's prediction of the served chain acceptance
(eyrie.training.acceptance): for each chain length k = 1..ttt_steps the expected acceptance length,
bonus token counted, simulated on held-out cache samples. The benchmark reads it here
(read_simulated_acceptance, simulated_length) to compare with what it measures.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import torch

from eyrie.core.artifacts import ArtifactError, load_safetensors, read_json, rebuild_hint
from eyrie.core.atomic import READABLE, write_directory_atomically, write_json_atomically, write_safetensors_atomically
from eyrie.core.digest import FILES_KEY, file_digest, recorded_files, verify_recorded_files
from eyrie.core.errors import EyrieError
from eyrie.drafter.model import ARCHITECTURE, DrafterShape, Eagle3Drafter
from eyrie.target.aux_layers import AuxLayerError, sglang_version_caveat, vllm_layer_ids

SIMULATED_ACCEPTANCE = "simulated_acceptance"  # the key under config.json's eyrie block
_ACCEPTANCE_LISTS = ("length", "per_step_accuracy")  # one entry per k, a number or null (no positions to measure)
_OPTIONAL_ACCEPTANCE_LISTS = ("conditional_accuracy", "conditional_length", "walked_length", "walked_first_turn_length")
# Training's forms of the prediction, the one nearest to what a decoder gets first (eyrie.training.acceptance).
PREDICTION_FORMS = ("walked_length", "conditional_length", "length")
READABLE_DIRECTORY = 0o755  # the drafter directory itself: listable by a server under another account
PARITY_SAMPLES_FILE = "parity_samples.json"  # eyrie.training.parity_samples' record, beside config.json, which records its digest
WRITTEN_BY = "train_drafter"  # the Snakemake rule that writes the drafter directory, named in read errors


class CheckpointError(EyrieError):
    """A drafter directory or its tensors are not what SGLang loads as an EAGLE-3 drafter."""


def check_checkpoint(tensors: dict[str, torch.Tensor], shape: DrafterShape, where: str | Path | None = None) -> None:
    """Every key SGLang expects, nothing else, each of the right shape, and every weight finite: SGLang skips unknown names
    silently, and serves NaN weights as a drafter whose every draft is rejected. `where` (the file) prefixes the error."""
    expected = shape.expected_tensors()
    missing = sorted(set(expected) - set(tensors))
    unexpected = sorted(set(tensors) - set(expected))
    problems = [f"missing {name}" for name in missing] + [f"unexpected {name}" for name in unexpected]
    for name, (dims, dtype) in expected.items():
        if name in tensors:
            if tuple(tensors[name].shape) != dims:
                problems.append(f"{name} has shape {tuple(tensors[name].shape)}, expected {dims}")
            if dtype is not None and tensors[name].dtype != dtype:
                problems.append(f"{name} has dtype {tensors[name].dtype}, expected {dtype}")
            if tensors[name].is_floating_point() and not bool(torch.isfinite(tensors[name]).all()):
                bad = int((~torch.isfinite(tensors[name])).sum())
                problems.append(f"{name} holds {bad} non-finite values (NaN or infinity) of {tensors[name].numel()}")
    if "fc.weight" in tensors and tensors["fc.weight"].shape[-1] != 3 * shape.target_hidden_size:
        problems.append(
            f"fc takes {tensors['fc.weight'].shape[-1]} inputs, but EAGLE-3 needs 3 x target hidden = {3 * shape.target_hidden_size} "
            "(three concatenated aux states, not the final state)"
        )
    if problems:
        prefix = f"{where}: " if where is not None else ""
        raise CheckpointError(f"{prefix}drafter checkpoint is not a servable EAGLE-3 drafter in SGLang's layout: " + "; ".join(problems))


def checkpoint_tensors(model: Eagle3Drafter, weight_dtype: torch.dtype = torch.bfloat16) -> dict[str, torch.Tensor]:
    """Exactly SGLang's tensors (no embeddings), checked before anything is written."""
    expected = model.shape.expected_tensors()
    state = model.state_dict()
    stray = [n for n, p in model.named_parameters() if p.requires_grad and n not in expected]
    if stray:
        raise CheckpointError(f"the drafter has trainable tensors SGLang would not load: {stray}")
    tensors = {name: state[name].detach().cpu().to(dtype or weight_dtype).contiguous() for name, (_, dtype) in expected.items()}
    check_checkpoint(tensors, model.shape)
    return tensors


def serving_config(config: dict, where: str | Path = "config.json") -> dict:
    """SGLang's config.json (DrafterShape.sglang_config) completed so that vLLM reads the same drafter from it.

    Adds (or checks) the top-level vLLM ids, norm_before_residual false, the four norm flags as trained and
    hidden_act silu; refuses aux ids that are not strictly ascending and a top-level id list that disagrees
    with the nested one. Returns a new dict; `where` names the file in errors.
    """
    config = json.loads(json.dumps(config))  # a copy: the caller's dict is not touched
    eagle = config.get("eagle_config")
    if not isinstance(eagle, dict) or "eagle_aux_hidden_state_layer_ids" not in eagle:
        raise CheckpointError(f"{where}: no eagle_config.eagle_aux_hidden_state_layer_ids (SGLang's aux layer ids)")
    try:
        vllm_ids = vllm_layer_ids(eagle["eagle_aux_hidden_state_layer_ids"])
    except AuxLayerError as err:
        raise CheckpointError(f"{where}: eagle_config.eagle_aux_hidden_state_layer_ids: {err}") from None
    written = config.get("eagle_aux_hidden_state_layer_ids")
    if written is not None and list(written) != vllm_ids:
        raise CheckpointError(
            f"{where}: top-level eagle_aux_hidden_state_layer_ids {written} (vLLM's convention) disagree with "
            f"eagle_config's {eagle['eagle_aux_hidden_state_layer_ids']} (SGLang's, + 1 = {vllm_ids}): one engine would fuse other layers"
        )
    if config.get("norm_before_residual", False):
        raise CheckpointError(f"{where}: norm_before_residual is true, but eyrie's drafter adds attention to the pre-norm state")
    shape = DrafterShape.from_sglang_config(config)  # SGLang's precedence for the norm flags
    config["eagle_aux_hidden_state_layer_ids"] = vllm_ids
    config["hidden_act"] = "silu"  # the drafter's MLP (DraftMLP); both engines refuse anything else
    config["norm_before_residual"] = False
    config["norm_before_fc"] = shape.norm_before_fc
    config["fc_norm"] = False  # one norm per aux state: not a variant eyrie trains
    config["norm_output"] = shape.norm_output
    return config


def write_checkpoint(out_dir: str | Path, config: dict, tensors: dict[str, torch.Tensor], training_log: list[dict],
                     parity_samples: dict | None = None) -> None:
    """The drafter directory, swapped in whole: readers see the old checkpoint or the new one, never a mix.

    config.json is completed for both engines (serving_config) and the tensors are checked against it first.
    parity_samples (eyrie.training.parity_samples) goes beside it as parity_samples.json, its digest in eyrie.files.
    """
    config_path = Path(out_dir) / "config.json"
    config = serving_config(config, config_path)
    check_checkpoint(tensors, DrafterShape.from_sglang_config(config), Path(out_dir) / "model.safetensors")
    caveat = sglang_version_caveat(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    if caveat:
        warnings.warn(f"{config_path}: {caveat}", stacklevel=2)

    def write(directory: Path) -> None:
        write_safetensors_atomically(tensors, directory / "model.safetensors", {"format": "pt"})
        write_json_atomically(directory / "training_log.json", training_log, indent=1)
        # config.json last: it records the digest of training_log.json, a JSON list with no field of its own.
        files = {"training_log.json": file_digest(directory / "training_log.json")}
        if parity_samples is not None:
            write_json_atomically(directory / PARITY_SAMPLES_FILE, parity_samples, indent=None)
            files[PARITY_SAMPLES_FILE] = file_digest(directory / PARITY_SAMPLES_FILE)
        config.setdefault("eyrie", {})[FILES_KEY] = files
        write_json_atomically(directory / "config.json", config, indent=2)
        for path in directory.iterdir():
            os.chmod(path, READABLE)  # whatever the umask: a server under another account reads these
        os.chmod(directory, READABLE_DIRECTORY)

    write_directory_atomically(out_dir, write)


def read_drafter_config(drafter_dir: str | Path) -> dict:
    """config.json of a drafter directory, checked against its digest; every failure names the file and how to rebuild it."""
    config_path = Path(drafter_dir) / "config.json"
    try:
        config = read_json(config_path, written_by=WRITTEN_BY, rebuild=drafter_dir)
    except ArtifactError as exc:
        raise CheckpointError(str(exc)) from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{config_path}: is a JSON {type(config).__name__}, not an object")
    return config


def load_drafter(drafter_dir: str | Path, target_embeddings: torch.Tensor) -> Eagle3Drafter:
    """A trained drafter (config.json + model.safetensors, safetensors only), its files checked against their digests,
    its tensors checked, in eval mode."""
    drafter_dir = Path(drafter_dir)
    config_path, weights_path = drafter_dir / "config.json", drafter_dir / "model.safetensors"
    if not config_path.is_file() or not weights_path.is_file():
        raise CheckpointError(f"{drafter_dir}: not a drafter directory (needs config.json and model.safetensors); {rebuild_hint(WRITTEN_BY, drafter_dir)}")
    config = read_drafter_config(drafter_dir)
    try:
        verify_recorded_files(drafter_dir, config)  # training_log.json, by the digest config.json records
    except ArtifactError as exc:
        raise CheckpointError(f"{exc}; {rebuild_hint(WRITTEN_BY, drafter_dir)}") from None
    try:
        tensors = load_safetensors(weights_path, written_by=WRITTEN_BY, rebuild=drafter_dir)
    except ArtifactError as exc:
        raise CheckpointError(str(exc)) from None
    if config.get("architectures") != [ARCHITECTURE]:
        raise CheckpointError(f"{config_path}: architectures is {config.get('architectures')!r}, expected [{ARCHITECTURE!r}]")
    if config.get("eagle_aux_hidden_state_layer_ids") is not None:  # drafters written before serving_config have none
        serving_config(config, config_path)  # the two engines' ids must name the same layers
    shape = DrafterShape.from_sglang_config(config)
    check_checkpoint(tensors, shape, weights_path)
    if tuple(target_embeddings.shape) != (shape.vocab_size, shape.hidden_size):
        raise CheckpointError(
            f"{drafter_dir}: target embeddings have shape {tuple(target_embeddings.shape)}, "
            f"the drafter was trained for ({shape.vocab_size}, {shape.hidden_size}); use the drafter's own target"
        )
    model = Eagle3Drafter(shape, target_embeddings.float(), tensors["d2t"], tensors["t2d"])
    model.load_state_dict({k: v.float() if v.is_floating_point() else v for k, v in tensors.items()}, strict=True)
    return model.eval()


def check_simulated_acceptance(summary, where: str | Path) -> dict:
    """The summary itself if it is well formed; else CheckpointError naming `where` (the config.json) and every problem."""
    if not isinstance(summary, dict):
        raise CheckpointError(f"{where}: eyrie.{SIMULATED_ACCEPTANCE} is {type(summary).__name__}, expected an object")
    problems = [f"missing {key}" for key in ("k", *_ACCEPTANCE_LISTS, "eval_samples", "source") if key not in summary]
    ks = summary.get("k")
    if "k" in summary and (not isinstance(ks, list) or ks != list(range(1, len(ks) + 1)) or not ks or any(isinstance(k, bool) for k in ks)):
        problems.append(f"k is {ks!r}, expected the chain lengths [1, 2, ..., ttt_steps]")
        ks = None
    for key in (k for k in (*_ACCEPTANCE_LISTS, *_OPTIONAL_ACCEPTANCE_LISTS) if k in summary):
        values = summary[key]
        if not isinstance(values, list) or any(v is not None and (isinstance(v, bool) or not isinstance(v, (int, float))) for v in values):
            problems.append(f"{key} is {values!r}, expected a list of numbers (or null)")
            continue
        if isinstance(ks, list) and len(values) != len(ks):
            problems.append(f"{key} has {len(values)} entries, k has {len(ks)}")
            continue
        for i, v in enumerate(values):
            low, high = (1.0, i + 2.0) if key.endswith("length") else (0.0, 1.0)  # a chain of k drafts accepts 1..k+1 tokens
            if v is not None and not low - 1e-9 <= v <= high + 1e-9:
                problems.append(f"{key}[{i}] is {v}, outside [{low:g}, {high:g}]")
    samples = summary.get("eval_samples")
    if "eval_samples" in summary and (isinstance(samples, bool) or not isinstance(samples, int) or samples < 0):
        problems.append(f"eval_samples is {samples!r}, expected a count")
    if "source" in summary and not isinstance(summary["source"], str):
        problems.append(f"source is {summary['source']!r}, expected a string")
    problems += _one_step_trees_problems(summary.get("one_step_trees"))
    by_dataset = summary.get("by_dataset", {})  # a run on several datasets: each one's held-out samples alone
    if not isinstance(by_dataset, dict) or any(not isinstance(v, dict) for v in by_dataset.values()):
        problems.append(f"by_dataset is {by_dataset!r}, expected an object of summaries by dataset")
    if problems:
        raise CheckpointError(f"{where}: eyrie.{SIMULATED_ACCEPTANCE} is malformed: " + "; ".join(problems))
    for name, own in by_dataset.items():
        check_simulated_acceptance(own, f"{where} (by_dataset.{name})")
    return summary


def _one_step_trees_problems(trees) -> list[str]:
    """What is wrong with a summary's one_step_trees (absent or null: nothing): {draft_tokens: [N, ...], walked_first_turn_length:
    [a length in [1, 2] or null per N]}; a one-step tree accepts the bonus token and at most one draft."""
    if trees is None:
        return []
    tokens = trees.get("draft_tokens") if isinstance(trees, dict) else None
    lengths = trees.get("walked_first_turn_length") if isinstance(trees, dict) else None
    if not isinstance(tokens, list) or any(isinstance(n, bool) or not isinstance(n, int) or n < 2 for n in tokens):
        return [f"one_step_trees is {trees!r}, expected {{draft_tokens: [N >= 2, ...], walked_first_turn_length: [...]}}"]
    if not isinstance(lengths, list) or len(lengths) != len(tokens) or any(
            v is not None and (isinstance(v, bool) or not isinstance(v, (int, float)) or not 1.0 - 1e-9 <= v <= 2.0 + 1e-9) for v in lengths):
        return [f"one_step_trees.walked_first_turn_length is {lengths!r}, expected one length in [1, 2] (or null) per draft_tokens entry"]
    return []


def read_simulated_acceptance(drafter_dir: str | Path) -> dict | None:
    """config.json's eyrie.simulated_acceptance, checked; None for a drafter trained before training wrote it."""
    config_path = Path(drafter_dir) / "config.json"
    config = read_drafter_config(drafter_dir)
    own = config.get("eyrie")
    if not isinstance(own, dict) or SIMULATED_ACCEPTANCE not in own:
        return None
    return check_simulated_acceptance(own[SIMULATED_ACCEPTANCE], config_path)


def read_parity_samples(drafter_dir: str | Path) -> dict | None:
    """parity_samples.json (training's held-out prompts with their walked first replies), checked against the digest config.json
    records for it and for its shape; None for a drafter written without it."""
    drafter_dir = Path(drafter_dir)
    config = read_drafter_config(drafter_dir)
    if PARITY_SAMPLES_FILE not in recorded_files(config):
        return None
    path = drafter_dir / PARITY_SAMPLES_FILE
    try:
        verify_recorded_files(drafter_dir, config)
        data = read_json(path, written_by=WRITTEN_BY, rebuild=drafter_dir)
    except ArtifactError as exc:
        raise CheckpointError(f"{exc}; {rebuild_hint(WRITTEN_BY, drafter_dir)}") from None
    ks = data.get("k") if isinstance(data, dict) else None
    if not isinstance(ks, list) or ks != list(range(1, len(ks) + 1)) or not isinstance(data.get("samples"), list):
        raise CheckpointError(f"{path}: expected an object with k = [1, ..., ttt_steps] and a list of samples")
    for i, sample in enumerate(data["samples"]):
        problem = _parity_sample_problem(sample, len(ks))
        if problem:
            raise CheckpointError(f"{path}: samples[{i}]: {problem}; {rebuild_hint(WRITTEN_BY, drafter_dir)}")
    return data


def _parity_sample_problem(sample, steps: int) -> str | None:
    if not isinstance(sample, dict):
        return f"is a {type(sample).__name__}, not an object"
    ids = sample.get("prompt_ids")
    if not isinstance(ids, list) or not ids or not all(isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in ids):
        return "prompt_ids is not a non-empty list of token ids"
    if not isinstance(sample.get("reply_tokens"), int) or sample["reply_tokens"] < 2:
        return f"reply_tokens is {sample.get('reply_tokens')!r}, expected a count of at least 2"
    rounds, emitted = sample.get("rounds"), sample.get("emitted")
    for name, values in (("rounds", rounds), ("emitted", emitted)):
        if not isinstance(values, list) or len(values) != steps or not all(isinstance(v, int) and not isinstance(v, bool) and v >= 0 for v in values):
            return f"{name} is not a list of {steps} counts"
    if any(not r <= e <= r * (k + 1) for k, (r, e) in enumerate(zip(rounds, emitted), 1)):
        return "emitted is not between rounds and rounds x (k + 1) for every k"
    return None


def predicted_lengths(summary: dict) -> tuple[str, list]:
    """(form, lengths per k) of training's best prediction of the served chain: the walked chain where the
    summary has it (a decoder's own rounds replayed on held-out tokens), else the conditional or product form
    of drafters trained before it."""
    for form in PREDICTION_FORMS:
        values = summary.get(form)
        if values and any(v is not None for v in values):
            return form, values
    return "length", summary["length"]


def first_turn_prediction(summary: dict) -> tuple[str, list]:
    """(form, lengths per k) to set beside a benchmark that serves first user turns: the walked chain over each held-out
    sample's first assistant reply where training recorded it, else predicted_lengths' (every turn)."""
    values = summary.get("walked_first_turn_length")
    if values and any(v is not None for v in values):
        return "walked_first_turn_length", values
    return predicted_lengths(summary)


def one_step_tree_prediction(summary: dict) -> dict[int, float]:
    """{N: training's walked acceptance of the one-step tree (1, N, N) over first replies} (check_simulated_acceptance
    checked its shape); empty for a drafter trained before training walked them, and without the trees it could not walk."""
    trees = summary.get("one_step_trees")
    if not trees:
        return {}
    return {n: float(v) for n, v in zip(trees["draft_tokens"], trees["walked_first_turn_length"]) if v is not None}


def simulated_length(summary: dict | None, k: int) -> float | None:
    """Training's expected acceptance length (bonus token counted) for a chain of k drafts (predicted_lengths); None
    without a summary, for k beyond the trained TTT steps, or where no positions were measured."""
    if summary is None or k not in summary["k"]:
        return None
    value = predicted_lengths(summary)[1][summary["k"].index(k)]
    return None if value is None else float(value)
