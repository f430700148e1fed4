"""Train the EAGLE-3 drafter on the target's hidden states, with training-time test (TTT): the job driver.

The states come from the hidden-state cache (hidden.mode offline) or from the target itself, run in this
job for each batch (hidden.mode online, eyrie.training.online); either way the same batches.
train_drafter runs one job in phases, each a function below, top to bottom: read and check the
inputs (eyrie.training.inputs), settle the run (ranks, device, precision, attention, steps), build
the drafter, its optimizer and the TTT objective (eyrie.training.objective), resume, the steps, and
write the checkpoint (eyrie.drafter.checkpoint). A non-finite loss or gradient stops the run at
that step (NonFiniteError, naming the batch's samples and their cache shards): NaN weights are
never written, and never resumed from. The TTT alignment is written down in
eyrie.training.objective. At each epoch's end (and the run's) the drafter's simulated acceptance
length on held-out cache samples (eyrie.training.holdout, eyrie.training.acceptance) goes into the
training log. With train.keep_best (the default) the weights written are those of the epoch with the
best simulated acceptance (eyrie.training.keep_best), else the last epoch's; that epoch's simulation
goes into config.json's eyrie.simulated_acceptance, and which epoch was kept, and why, into the last
training-log entry's and config.json's eyrie ``kept``. Training steps may add uniform noise to the
cached aux states (train.hidden_noise, eyrie.training.noise).

State for resuming lives in ``state_dir`` (eyrie.training.state: safetensors for tensors, JSON for
the rest, each written then renamed); the declared output directory is written once, at the end,
atomically.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from eyrie.core.errors import EyrieError
from eyrie.core.schema import with_defaults
from eyrie.drafter.checkpoint import SIMULATED_ACCEPTANCE, check_simulated_acceptance, checkpoint_tensors, write_checkpoint
from eyrie.drafter.model import Eagle3Drafter
from eyrie.drafter.rms_norm import fuses_norms
from eyrie.drafter.pointwise import fuses_pointwise
from eyrie.target.head import TargetHeadError, load_target_head
from eyrie.training import weight_grads
from eyrie.training.acceptance import acceptance_line, simulate_acceptance
from eyrie.training.batches_ahead import batches_on_device, pins_memory
from eyrie.training.distributed import DistributedContext, data_parallel, distributed_context, rank_share
from eyrie.training.draft_loss import fuses_loss
from eyrie.training.errors import NonFiniteError, TrainingInputError
from eyrie.training.holdout import HELD_OUT_SOURCE, TRAINING_SOURCE
from eyrie.training.inputs import HiddenCache, StateSource, TrainingInputs, read_inputs
from eyrie.training.keep_best import best_record, is_better, kept_note, restore, snapshot
from eyrie.training.metrics import add_step, final_metrics, log_entry, log_line, new_window
from eyrie.training.noise import add_hidden_noise
from eyrie.training.objective import TTTObjective, train_step
from eyrie.training.online import OnlineStates
from eyrie.training.optimizer import learning_rate, make_optimizer
from eyrie.training.parity_samples import parity_samples
from eyrie.training.state import RunRecord, epoch_order, load_state, run_identity, save_state
from eyrie.training.ttt_attention import resolve_attention


@dataclass
class _Run:
    """One training job's inputs and settings, settled before the first step."""

    inputs: TrainingInputs
    drafter_cfg: dict
    train_cfg: dict
    template_sha256: str
    target_fingerprint: str
    ranks: DistributedContext
    use_bf16: bool  # bf16 autocast
    frozen_dtype: torch.dtype  # of the frozen embeddings, the target's head and the batches: bf16 under autocast
    weight_dtype: torch.dtype  # of the written checkpoint
    attention: str  # "eager" or "flex" (eyrie.training.ttt_attention)
    fused_loss: bool  # train.fused_loss settled: the loss's elementwise work through torch.compile (eyrie.training.draft_loss)
    fused_norms: bool  # train.fused_norms settled: the RMSNorms' math through torch.compile (eyrie.drafter.rms_norm)
    fused_pointwise: bool  # train.fused_pointwise settled: the rotary and SiLU * up through torch.compile (eyrie.drafter.pointwise)
    fused_weight_grads: str | None  # train.fused_weight_grads settled: None, "compute" or "float32" (eyrie.training.weight_grads)
    ttt_steps: int
    steps_per_epoch: int
    total_steps: int


@dataclass
class _Trainer:
    """The drafter and what trains it."""

    model: Eagle3Drafter
    optimizer: torch.optim.Optimizer
    objective: torch.nn.Module | None  # the TTTObjective, inside DistributedDataParallel when there are several ranks
    compiled: Any  # the objective's CompiledLayers (train.compile) or None; kept here: DDP hides the objective's attributes
    loss_chunks: Any  # the objective's LossChunks (train.fused_loss), kept here for the same reason
    norm_kernels: Any  # the objective's NormKernels (train.fused_norms), kept here for the same reason
    pointwise_kernels: Any  # the objective's PointwiseKernels (train.fused_pointwise), likewise
    target_lm_head: torch.Tensor
    draft_ids: torch.Tensor  # target id of each draft id, on the device
    t2d: torch.Tensor
    kept: dict[str, torch.Tensor] | None = None  # train.keep_best: the best epoch's weights so far (rank 0, in the checkpoint's dtype)


def train_drafter(
    *,
    hidden_paths: list[str] | None = None,
    vocab_path: str,
    target_dir: str,
    out_dir: str,
    state_dir: str,
    drafter_cfg: dict,
    train_cfg: dict,
    template_sha256: str,
    target_fingerprint: str,
    progress: bool = True,
    save_every_steps: int = 200,
    save_every_seconds: float = 600.0,
    on_step=None,
    token_paths: list[str] | None = None,
    hidden_cfg: dict | None = None,
    model_cfg: dict | None = None,
) -> dict:
    """Train the drafter and write out_dir (config.json, model.safetensors, training_log.json) once, atomically.

    The states: hidden.mode offline (hidden_cfg's mode, the default) reads the cache shards hidden_paths;
    online runs the target (target_dir, loaded as model_cfg's dtype and trust_remote_code say) over the token
    shards token_paths, rounding its states through hidden_cfg's dtype as the cache would.

    Resumes from state_dir when a state of the same inputs and settings is there; saves one every
    save_every_steps steps or save_every_seconds seconds and at the end of each epoch.
    on_step(step) is called after each completed optimizer step (tests use it to interrupt).

    Several GPUs (data parallel): launch under torchrun, which sets WORLD_SIZE, RANK, LOCAL_RANK,
    MASTER_ADDR and MASTER_PORT; train_drafter sees WORLD_SIZE > 1, joins the group (NCCL on CUDA,
    one GPU per LOCAL_RANK; gloo on CPU) and wraps the model in DistributedDataParallel. Each
    step's batch (batch_tokens padded tokens, as on one GPU) is dealt out by rows, the loss is
    normalised over all ranks' positions, so the run follows the one-rank loss curve; rank 0 alone
    writes state_dir, out_dir and the log. From a shell (or a Snakemake ``shell:`` rule), with the
    keyword arguments of this function in a JSON file:

        NCCL_NVLS_ENABLE=0 python -m torch.distributed.run --standalone --nproc_per_node 2 -m eyrie.training.train args.json
    """
    drafter_cfg, train_cfg = with_defaults("drafter", drafter_cfg), with_defaults("train", train_cfg)
    states = _state_source(hidden_paths, token_paths, target_dir, with_defaults("hidden", hidden_cfg), with_defaults("model", model_cfg))
    inputs = read_inputs(
        states=states, vocab_path=vocab_path, target_dir=target_dir, drafter_cfg=drafter_cfg,
        batch_tokens=int(train_cfg["batch_tokens"]), template_sha256=template_sha256, target_fingerprint=target_fingerprint,
        eval_fraction=float(train_cfg["eval_fraction"]),
        trust_remote_code=bool(with_defaults("model", model_cfg)["trust_remote_code"]),
    )
    run = _settle_run(inputs, drafter_cfg, train_cfg, template_sha256, target_fingerprint)
    say = _printer(progress and run.ranks.rank == 0)
    if isinstance(states, OnlineStates):  # once per job, on this rank's device; before the drafter, whose init stays the seed's
        states.load_target(run.ranks.device)
    trainer = _build_trainer(run, target_dir)

    state_path = Path(state_dir)
    run_id = run_identity(inputs.states.manifests, inputs.d2t, drafter_cfg, train_cfg, template_sha256, target_fingerprint, inputs.states.digests)
    record = _resume(run, trainer, state_path, run_id, say)
    resumed_from = record.step
    if run.ranks.world > 1:  # after resuming: DDP starts every rank from rank 0's weights
        trainer.objective = data_parallel(trainer.objective, run.ranks.device)
    say(_plan_line(run, trainer))
    say(inputs.eval_note)
    if inputs.truncated and run.ranks.rank == 0:  # a warning whether or not progress lines are printed
        print(truncation_warning(inputs.truncated, int(train_cfg["batch_tokens"])), file=sys.stderr, flush=True)

    def save() -> None:
        save_state(state_path, run_id, record, trainer.model, trainer.optimizer, trainer.kept)

    compile_fallback = _train_steps(run, trainer, record, save, on_step, say, save_every_steps=save_every_steps, save_every_seconds=save_every_seconds)
    acceptance, kept = _kept_weights(run, trainer, record, _final_acceptance(run, trainer, record, say), say)
    parity = _parity_samples(run, trainer) if run.ranks.rank == 0 else None  # of the weights written
    summary = _write_output(run, trainer, record, resumed_from, compile_fallback, acceptance, kept, out_dir, say, parity)

    # DDP's reducer holds the gloo group: freed with it, the group's destructor joins its worker threads
    # while holding the GIL that a worker needs to free its last tensors, and the rank hangs at exit
    # (3 runs in 10 of the two-rank test). Freed first, the group goes in destroy_process_group instead.
    trainer.objective = None
    run.ranks.close()
    return summary


# --------------------------------------------------------------------------- the phases, in order


def _state_source(hidden_paths, token_paths, target_dir: str, hidden_cfg: dict, model_cfg: dict) -> StateSource:
    """Where the target's states come from: the cache (hidden.mode offline) or the target, run here (online)."""
    if hidden_cfg["mode"] == "online":
        return OnlineStates(token_paths or [], target_dir=target_dir, dtype=str(hidden_cfg["dtype"]), model_dtype=str(model_cfg["dtype"]),
                            trust_remote_code=bool(model_cfg["trust_remote_code"]))
    return HiddenCache(hidden_paths or [])


def _settle_run(inputs: TrainingInputs, drafter_cfg: dict, train_cfg: dict, template_sha256: str, target_fingerprint: str) -> _Run:
    """Join the ranks (under torchrun), choose device, precision and attention, and count the steps."""
    ranks = distributed_context(train_cfg["device"])
    dtype = train_cfg["dtype"]
    use_bf16 = dtype == "bfloat16" or (dtype == "auto" and torch.device(ranks.device).type == "cuda")
    try:
        attention = resolve_attention(str(train_cfg["attention"]), ranks.device, inputs.shape.head_dim)
    except EyrieError as exc:
        raise TrainingInputError(str(exc)) from None
    steps_per_epoch = len(inputs.batches)
    return _Run(
        inputs=inputs,
        drafter_cfg=drafter_cfg,
        train_cfg=train_cfg,
        template_sha256=template_sha256,
        target_fingerprint=target_fingerprint,
        ranks=ranks,
        use_bf16=use_bf16,
        # Under bf16 autocast the frozen tensors live in bf16 (2 GB less each at a 128K x 4096 vocab);
        # the trained weights stay float32 masters for AdamW.
        frozen_dtype=torch.bfloat16 if use_bf16 else torch.float32,
        weight_dtype=torch.float32 if dtype == "float32" else torch.bfloat16,
        attention=attention,
        fused_loss=fuses_loss(train_cfg["fused_loss"], ranks.device),
        fused_norms=fuses_norms(train_cfg["fused_norms"], ranks.device),
        fused_pointwise=fuses_pointwise(train_cfg["fused_pointwise"], ranks.device),
        fused_weight_grads=weight_grads.settle(train_cfg["fused_weight_grads"], ranks.device),
        ttt_steps=int(drafter_cfg["ttt_steps"]),
        steps_per_epoch=steps_per_epoch,
        total_steps=max(1, math.ceil(float(train_cfg["epochs"]) * steps_per_epoch)),
    )


def _build_trainer(run: _Run, target_dir: str) -> _Trainer:
    """The drafter on the target's frozen embeddings, its head started from the target's LM head rows; AdamW; the TTT objective."""
    inputs, device, cfg = run.inputs, run.ranks.device, run.train_cfg
    try:
        head = load_target_head(target_dir, inputs.target_config)
    except TargetHeadError as exc:
        raise TrainingInputError(str(exc)) from None
    draft_ids = torch.arange(int(inputs.d2t.numel()), dtype=torch.int64) + inputs.d2t
    torch.manual_seed(int(cfg["seed"]))
    model = Eagle3Drafter(inputs.shape, head["embed"].to(run.frozen_dtype), inputs.d2t, inputs.t2d)
    with torch.no_grad():
        model.lm_head.weight.copy_(head["lm_head"][draft_ids])
        if head["norm"] is not None:
            model.norm.weight.copy_(head["norm"])
    target_lm_head = head["lm_head"].to(device=device, dtype=run.frozen_dtype)
    del head  # the float32 copies, before the model moves to the device
    model.to(device)
    optimizer = make_optimizer(model, float(cfg["learning_rate"]), float(cfg["weight_decay"]))
    objective = TTTObjective(model, run.ttt_steps, float(run.drafter_cfg["step_weight_decay"]), attention=run.attention,
                             recompute_mlp=bool(cfg["recompute_mlp"]), compile=bool(cfg["compile"]),
                             hard_label_weight=float(cfg["hard_label_weight"]), fused_loss=run.fused_loss,
                             copy_weight=float(cfg["copy_weight"]), prompt_label_weight=float(cfg["prompt_label_weight"]),
                             fused_weight_grads=run.fused_weight_grads, fused_norms=run.fused_norms,
                             fused_pointwise=run.fused_pointwise)
    return _Trainer(model, optimizer, objective, objective.compiled, objective.loss_chunks, objective.norm_kernels,
                    objective.pointwise_kernels, target_lm_head,
                    draft_ids.to(device), inputs.t2d.to(device))


def _resume(run: _Run, trainer: _Trainer, state_dir: Path, run_id: str, say: Callable[[str], None]) -> RunRecord:
    """This run's saved record (weights, optimizer, RNG and the kept epoch's weights restored in place), or a fresh one."""
    saved = load_state(state_dir, run_id, trainer.model, trainer.optimizer, say)
    if saved is None:
        return RunRecord.start(run.ttt_steps)
    record, kept = saved
    trainer.kept = kept if record.best is not None and run.ranks.rank == 0 else None
    say(f"train: resuming at step {record.step} of {run.total_steps} from {state_dir}")
    return record


def _plan_line(run: _Run, trainer: _Trainer) -> str:
    inputs, cfg, batch_tokens = run.inputs, run.train_cfg, int(run.train_cfg["batch_tokens"])
    return (
        f"train: {len(inputs.samples)} samples in {run.steps_per_epoch} batches of <= {batch_tokens} tokens, {run.total_steps} steps "
        f"({cfg['epochs']} epochs), {run.ttt_steps} TTT steps, draft vocab {inputs.shape.draft_vocab_size}, device {run.ranks.device}"
        f"{', bf16 autocast' if run.use_bf16 else ', fp32'}, {run.attention} attention"
        + (", layer elementwise work compiled (train.compile)" if trainer.compiled is not None else "")
        + (", loss elementwise work fused (train.fused_loss)" if trainer.loss_chunks.fused else "")
        + (", RMSNorms fused (train.fused_norms)" if trainer.norm_kernels.fused else "")
        + (", rotary and SiLU * up fused (train.fused_pointwise)" if trainer.pointwise_kernels.fused else "")
        + ({"compute": ", weight gradients summed by the products (train.fused_weight_grads)",
            "float32": ", weight gradients summed in float32 by the products (train.fused_weight_grads: float32)"}.get(run.fused_weight_grads, ""))
        + (f", {run.ranks.world} ranks" if run.ranks.world > 1 else "")
        + f"; {cfg['lr_schedule']} learning rate, {'keeping the best epoch' if cfg['keep_best'] else 'keeping the last epoch'}"
        + (f", aux noise U(-{cfg['hidden_noise']:g}, {cfg['hidden_noise']:g})" if float(cfg["hidden_noise"]) > 0 else "")
        + (f", labels {cfg['hard_label_weight']:g} the target's argmax" if float(cfg["hard_label_weight"]) > 0 else "")
        + (f", labels in copied stretches weighted x{cfg['copy_weight']:g}" if float(cfg["copy_weight"]) != 1 else "")
        + (f", the prompts' tokens trained on too, weighted x{cfg['prompt_label_weight']:g}" if float(cfg["prompt_label_weight"]) > 0 else "")
        + (", the target's states computed here for each batch (hidden.mode online)" if isinstance(inputs.states, OnlineStates) else "")
        + "".join(f", drafter.{flag}" for flag in ("norm_before_fc", "norm_output") if getattr(inputs.shape, flag))
        + (f", MLP width {inputs.shape.intermediate_size} (the target's {inputs.target_config.intermediate_size})"
           if inputs.shape.intermediate_size != inputs.target_config.intermediate_size else "")
        + (f"; {inputs.truncated} samples truncated to {batch_tokens} tokens" if inputs.truncated else "")
        + (f"; {inputs.skipped} samples skipped (nothing to train)" if inputs.skipped else "")
    )


def _train_steps(
    run: _Run, trainer: _Trainer, record: RunRecord, save: Callable[[], None], on_step, say: Callable[[str], None],
    *, save_every_steps: int, save_every_seconds: float,
) -> dict | None:
    """The optimizer steps from record.step to the last, logged into record and saved as they go.

    Returns {"step", "error"} of the first step whose pieces could not be compiled (train.compile), or None.
    """
    cfg, ranks, batches = run.train_cfg, run.ranks, run.inputs.batches
    seed, base_lr, warmup_ratio, schedule = int(cfg["seed"]), float(cfg["learning_rate"]), float(cfg["warmup_ratio"]), str(cfg["lr_schedule"])
    noise = float(cfg["hidden_noise"])
    compiled = trainer.compiled
    compile_fallback = None
    loss_fallback_said = norms_fallback_said = pointwise_fallback_said = False
    last_save = time.perf_counter()
    trainer.model.train()
    states = run.inputs.states
    pin = states.moves_ahead and pins_memory(ranks.device)

    def load(step: int):  # in a background thread, while the step before computes
        epoch, index = divmod(step, run.steps_per_epoch)
        whole = batches[epoch_order(seed, epoch, run.steps_per_epoch)[index]]
        refs, weight = rank_share(whole, ranks.rank, ranks.world)
        return epoch, whole, refs, weight, states.load(refs, pin=pin)

    def to_device(planned):  # in the background thread too where the source moves ahead (on CUDA, on a side stream)
        return states.to_device(planned[-1], ranks.device, dtype=run.frozen_dtype)

    steps = range(record.step, run.total_steps)
    with contextlib.closing(batches_on_device(load, to_device, steps, ranks.device, ahead=states.moves_ahead)) as loads:
        for step in steps:
            t0 = time.perf_counter()
            (epoch, whole, refs, weight, _), batch = next(loads)
            if noise > 0:  # training batches only: the held-out simulation reads the cache as it is
                add_hidden_noise(batch["aux"], refs, noise, seed=seed, epoch=epoch)
            batch["weight"] = weight
            lr = learning_rate(step, run.total_steps, base_lr, warmup_ratio, schedule)
            for group in trainer.optimizer.param_groups:
                group["lr"] = lr
            result = train_step(
                trainer.objective, trainer.optimizer, batch, target_lm_head=trainer.target_lm_head, draft_ids=trainer.draft_ids,
                t2d=trainer.t2d, max_grad_norm=float(cfg["max_grad_norm"]), use_bf16=run.use_bf16,
            )
            del batch
            if not (math.isfinite(result["loss"]) and math.isfinite(result["grad_norm"])):  # the same figures on every rank
                raise NonFiniteError(_non_finite_message(run, step + 1, whole, result))
            elapsed = time.perf_counter() - t0
            if compiled is not None and compiled.error is not None and compile_fallback is None:
                compile_fallback = {"step": step + 1, "error": compiled.error}
                say(f"train: train.compile failed in step {step + 1}; training goes on eagerly (the same training at eager speed): {compiled.error}")
            if trainer.loss_chunks.error is not None and not loss_fallback_said:
                loss_fallback_said = True
                say(f"train: train.fused_loss failed in step {step + 1}; the loss runs eagerly (same values, eager speed): {trainer.loss_chunks.error}")
            if trainer.norm_kernels.error is not None and not norms_fallback_said:
                norms_fallback_said = True
                say(f"train: train.fused_norms failed in step {step + 1}; the norms run eagerly (same values, eager speed): "
                    f"{trainer.norm_kernels.error}")
            if trainer.pointwise_kernels.error is not None and not pointwise_fallback_said:
                pointwise_fallback_said = True
                say(f"train: train.fused_pointwise failed in step {step + 1}; the rotary and SiLU * up run eagerly (same values, eager speed): "
                    f"{trainer.pointwise_kernels.error}")
            done = record.step = step + 1
            record.tokens += result["tokens"]
            record.seconds += elapsed
            add_step(record.window, result, elapsed)

            epoch_end = done % run.steps_per_epoch == 0 or done == run.total_steps
            # Outside the step's time; every rank takes part (each simulates whole batches, the counts are all-reduced).
            evaluation = _simulate(run, trainer, done) if epoch_end else None
            if evaluation is not None:
                record.pending_eval.append(evaluation)
                _consider(run, trainer, record, evaluation)
            if done % int(cfg["log_every"]) == 0 or done == run.total_steps:
                entry = log_entry(record.window, done, run.steps_per_epoch, lr, run.ttt_steps)
                if compiled is not None:  # False once compiling failed and the steps run eagerly
                    entry["compiled"] = compiled.active
                if record.pending_eval:  # the epochs that ended since the last entry (usually this step's one)
                    entry["eval"], record.pending_eval = record.pending_eval, []
                record.log.append(entry)
                say(log_line(entry, run.ttt_steps))
                record.window = new_window(run.ttt_steps)
            if evaluation is not None:
                say(acceptance_line(evaluation))
            if ranks.rank == 0 and (epoch_end or done % save_every_steps == 0 or time.perf_counter() - last_save >= save_every_seconds):
                save()
                last_save = time.perf_counter()
            if on_step is not None:
                on_step(done)
    return compile_fallback


def _non_finite_message(run: _Run, step: int, whole: list, result: dict) -> str:
    """Why training stopped at `step`: the batch's samples by shard, and whether their states are the cause."""
    states = run.inputs.states
    listing = "; ".join(f"{path}: {', '.join(ids)}" for path, ids in states.describe(whole).items())
    corrupt = states.describe(states.non_finite(whole))
    if corrupt:
        cause = "; ".join(states.not_finite_cause(path, ids) for path, ids in corrupt.items())
    else:
        cause = (
            f"the batch's {states.states_name} are finite, so training diverged: lower train.learning_rate, or train.max_grad_norm, "
            "or train in float32 (train.dtype)"
        )
    return (
        f"train: step {step} (epoch {(step - 1) // run.steps_per_epoch + 1}) has a non-finite loss or gradient "
        f"(loss {result['loss']}, gradient norm {result['grad_norm']}); stopped, no drafter written. "
        f"The step's batch: {listing}. {cause[0].upper()}{cause[1:]}"
    )


def _simulate(run: _Run, trainer: _Trainer, step: int) -> dict:
    """The drafter's simulated acceptance after `step` (eyrie.training.acceptance), as a training-log eval record."""
    inputs = run.inputs
    result = simulate_acceptance(
        trainer.model, inputs.states, inputs.eval_batches, rank=run.ranks.rank, world=run.ranks.world, device=run.ranks.device,
        dtype=run.frozen_dtype, source=HELD_OUT_SOURCE if inputs.held_out else TRAINING_SOURCE,
        samples=sum(len(b) for b in inputs.eval_batches), datasets=inputs.eval_datasets,
        target_lm_head=trainer.target_lm_head, draft_ids=trainer.draft_ids,
        t2d=trainer.t2d, steps=run.ttt_steps, attention=run.attention, use_bf16=run.use_bf16,
    )
    return {"epoch": step / run.steps_per_epoch, "step": step, **result}


def _consider(run: _Run, trainer: _Trainer, record: RunRecord, evaluation: dict) -> None:
    """train.keep_best: an epoch's evaluation at least as good as the best so far becomes the kept one, with its weights."""
    if not bool(run.train_cfg["keep_best"]) or not is_better(evaluation, record.best):
        return
    record.best = best_record(evaluation)
    if run.ranks.rank == 0:  # the rank that saves the state and writes the checkpoint
        trainer.kept = snapshot(trainer.model, run.weight_dtype)


def _final_acceptance(run: _Run, trainer: _Trainer, record: RunRecord, say: Callable[[str], None]) -> dict:
    """The simulated acceptance of the final weights: the last step's eval record (simulated again if a resumed record lacks it)."""
    evaluations = [e for entry in record.log for e in entry.get("eval", [])] + record.pending_eval
    if evaluations and evaluations[-1]["step"] == run.total_steps:
        return evaluations[-1]
    evaluation = _simulate(run, trainer, run.total_steps)
    say(acceptance_line(evaluation))
    _consider(run, trainer, record, evaluation)
    return evaluation


def _kept_weights(run: _Run, trainer: _Trainer, record: RunRecord, last: dict, say: Callable[[str], None]) -> tuple[dict, dict]:
    """(the simulated acceptance of the weights to write, training_log.json's and config.json's ``kept``); with
    train.keep_best the model now holds the best epoch's weights."""
    keep_best = bool(run.train_cfg["keep_best"])
    kept = kept_note(record.best, last, keep_best)
    if record.log:
        record.log[-1]["kept"] = kept
    if not keep_best or record.best is None or record.best["step"] == last["step"]:
        return last, kept
    if trainer.kept is not None:  # rank 0; the other ranks write nothing
        restore(trainer.model, trainer.kept)
    say(f"train: writing the weights of epoch {kept['epoch']:g} (step {kept['step']}): {kept['by']}")
    return record.best["evaluation"], kept


def _parity_samples(run: _Run, trainer: _Trainer) -> dict | None:
    """Some held-out samples' prompts and walked first replies, for the benchmark to serve (eyrie.training.parity_samples)."""
    return parity_samples(
        trainer.model, run.inputs.states, run.inputs.held_out, device=run.ranks.device, dtype=run.frozen_dtype, steps=run.ttt_steps,
        target_lm_head=trainer.target_lm_head, draft_ids=trainer.draft_ids, t2d=trainer.t2d, attention=run.attention, use_bf16=run.use_bf16,
    )


def _write_output(run: _Run, trainer: _Trainer, record: RunRecord, resumed_from: int, compile_fallback: dict | None, acceptance: dict,
                  kept: dict, out_dir: str, say: Callable[[str], None], parity: dict | None = None) -> dict:
    """The run's summary; rank 0 also writes the drafter directory (SGLang's config with eyrie's provenance, the weights, the log)."""
    metrics = final_metrics(record.log, run.steps_per_epoch, run.ttt_steps)
    summary = {
        "steps": run.total_steps,
        "resumed_from_step": resumed_from,
        "epochs": float(run.train_cfg["epochs"]),
        "steps_per_epoch": run.steps_per_epoch,
        "samples": len(run.inputs.samples),
        "tokens": record.tokens,
        "seconds": record.seconds,
        "tokens_per_second": record.tokens / max(record.seconds, 1e-9),
        "final_accuracy_per_step": metrics.get("accuracy_per_step"),
        "final_loss_per_step": metrics.get("loss_per_step"),
        "final_loss": metrics.get("loss"),
        "draft_vocab_size": run.inputs.shape.draft_vocab_size,
        "ttt_steps": run.ttt_steps,
        SIMULATED_ACCEPTANCE: acceptance,
        "kept": kept,
    }
    if trainer.compiled is not None:
        summary["compile"] = {"compiled": trainer.compiled.active, "fallback": compile_fallback}
    if trainer.loss_chunks.fused:
        summary["fused_loss"] = {"fused": trainer.loss_chunks.active, "fallback": trainer.loss_chunks.error}
    if trainer.norm_kernels.fused:
        summary["fused_norms"] = {"fused": trainer.norm_kernels.active, "fallback": trainer.norm_kernels.error}
    if trainer.pointwise_kernels.fused:
        summary["fused_pointwise"] = {"fused": trainer.pointwise_kernels.active, "fallback": trainer.pointwise_kernels.error}
    if run.fused_weight_grads is not None:  # fallback: float32 sums through float32 copies (the same sums, slower)
        summary["fused_weight_grads"] = {"sums": run.fused_weight_grads, "fallback": weight_grads.fallback_reason}
    if run.ranks.rank != 0:
        return summary
    tensors = checkpoint_tensors(trainer.model, run.weight_dtype)
    vocab_manifest = run.inputs.vocab_manifest
    config = run.inputs.shape.sglang_config(torch_dtype=str(run.weight_dtype).removeprefix("torch."))
    config["eyrie"] = {
        "template_sha256": run.template_sha256,
        "target_fingerprint": run.target_fingerprint,
        "drafter": run.drafter_cfg,
        "train": run.train_cfg,
        "vocab": {k: vocab_manifest.get(k) for k in ("draft_vocab_size", "requested_draft_vocab_size", "coverage", "clipped") if k in vocab_manifest},
        "metrics": {**metrics, **{k: summary[k] for k in ("steps", "samples", "tokens", "seconds", "tokens_per_second", "compile", "fused_loss", "fused_norms", "fused_pointwise", "fused_weight_grads") if k in summary}},
        SIMULATED_ACCEPTANCE: check_simulated_acceptance(acceptance, Path(out_dir) / "config.json"),
        "kept": kept,
    }
    write_checkpoint(out_dir, config, tensors, record.log, parity_samples=parity)
    say(f"train: wrote {out_dir} ({run.total_steps} steps, {record.tokens} tokens, {summary['tokens_per_second']:.0f} tok/s)")
    return summary


def truncation_warning(truncated: int, batch_tokens: int) -> str:
    """The job log's line for samples training cuts: one step holds at most train.batch_tokens tokens of one sample."""
    return (f"warning: train: {truncated} sample(s) longer than train.batch_tokens = {batch_tokens} are cut to {batch_tokens} tokens; "
            "raise train.batch_tokens to at least the longest sample (tokenize.max_seq_len) to train them whole")


def _printer(enabled: bool) -> Callable[[str], None]:
    """say(line): one progress line on stderr, or nothing (progress=False, or a rank other than 0)."""

    def say(line: str) -> None:
        if enabled:
            print(line, file=sys.stderr, flush=True)

    return say


def main(argv: list[str] | None = None) -> int:
    """`python -m eyrie.training.train ARGS.json`: train_drafter(**ARGS), the entry point for torchrun launches."""
    argv = sys.argv[1:] if argv is None else argv
    if len(argv) != 1:
        print("usage: python -m eyrie.training.train ARGS.json  (keyword arguments of eyrie.training.train.train_drafter)", file=sys.stderr)
        return 2
    train_drafter(**json.loads(Path(argv[0]).read_text()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
