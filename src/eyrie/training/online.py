"""hidden.mode online: the target's states computed in the training job, batch by batch, instead of read from a cache.

OnlineStates reads the token shards the extract job would have read and holds their samples exactly as
HiddenCache holds the cache's (eyrie.training.inputs.StateSource: same shards, same order, same filter), so a
seed plans the same batches. Its states come from the extract job's own forward (eyrie.target.states), are
rounded through hidden.dtype as the cache stores them (eyrie.hidden.cache.encode_rows) and widened as the
cache's reader widens them: a batch is the batch HiddenCache would return, up to the target forward's
float noise under another padding. Nothing is written to disk; each step pays a target forward instead.

The target is loaded once per job, on the device of the first batch (the training device, one per rank),
in eval mode, frozen, and runs under no_grad. hidden.dtype float8_e4m3fn is refused: it is a storage
format, and online nothing is stored. The resume identity records each token shard's content digest
(the target's fingerprint is in it already).
"""

from __future__ import annotations

import torch

from eyrie.core.artifacts import check
from eyrie.core.digest import file_digest
from eyrie.tokens.shards import WRITTEN_BY as TOKENS_WRITTEN_BY
from eyrie.tokens.shards import read_tokens, shard_template
from eyrie.hidden.cache import encode_rows, storage_dtype
from eyrie.target.aux_layers import capture_indices
from eyrie.target.model import load_model
from eyrie.target.states import TargetStates
from eyrie.training.errors import TrainingInputError
from eyrie.training.inputs import Sample, StateSource, padded_batch

ONLINE_DTYPES = ("bfloat16", "float32")
FORMAT = "eyrie-online/1"  # what the resume identity records of a token shard, in place of a cache manifest


class OnlineStates(StateSource):
    """The token shards' samples, with the target's states computed for each batch.

    dtype: hidden.dtype (the cache's storage rounding); model_dtype, trust_remote_code: model.dtype and
    model.trust_remote_code, how the target is loaded (as the extract job loads it).
    """

    states_name = "online states"

    def __init__(self, token_paths: list[str], *, target_dir: str, dtype: str = "bfloat16", model_dtype: str = "auto",
                 trust_remote_code: bool = False):
        if not token_paths:
            raise TrainingInputError("no token shards given (hidden.mode online trains on the token shards)")
        if dtype not in ONLINE_DTYPES:
            raise TrainingInputError(
                f"hidden.dtype {dtype!r} with hidden.mode online: float8 is how a cache is stored, and online nothing is; "
                f"use one of {', '.join(ONLINE_DTYPES)}"
            )
        self.paths = [str(p) for p in token_paths]
        self.target_dir, self.model_dtype, self.trust_remote_code = str(target_dir), str(model_dtype), bool(trust_remote_code)
        self.storage = storage_dtype(dtype)
        # Each shard's digest checked once here (read_tokens checks it again as it reads: the shards are small).
        self.digests = [check(p, "parquet", written_by=TOKENS_WRITTEN_BY) or file_digest(p) for p in self.paths]
        self.templates = [shard_template(p) for p in self.paths]
        self.names, self.input_ids, self.loss_mask, self.offsets = [], [], [], []
        for path in self.paths:
            columns = read_tokens(path, TrainingInputError)
            self.names.append(columns.ids)
            self.input_ids.append(torch.from_numpy(columns.input_ids).long())
            self.loss_mask.append(torch.from_numpy(columns.loss_mask).bool())
            self.offsets.append(torch.from_numpy(columns.offsets).long())
        self.manifests = [
            {"format": FORMAT, "dtype": dtype, "model_dtype": self.model_dtype, "template_sha256": template,
             "samples": len(ids), "tokens": int(offsets[-1])}
            for template, ids, offsets in zip(self.templates, self.names, self.offsets)
        ]
        self.capture: list[int] | None = None  # set by check
        self.model = None  # load_target (the training job loads it before the first step)

    def check(self, *, target_config, aux_layer_ids: list[int], template_sha256: str, target_fingerprint: str) -> list[int]:
        """The shards were tokenized with the target's template; the states will be of aux_layer_ids (returned)."""
        for path, template in zip(self.paths, self.templates):
            if template != template_sha256:
                raise TrainingInputError(
                    f"{path}: tokenized with chat template {template!r}, but the target's template is {template_sha256!r}; "
                    "re-tokenize with this target or point model.path at the one used"
                )
        self.capture = capture_indices(aux_layer_ids, int(target_config.num_hidden_layers))
        return [int(i) for i in aux_layer_ids]

    def load_target(self, device):
        """The target on device (loaded by the first call; later calls return it wherever it is), frozen, in eval mode."""
        if self.model is None:
            self.model = load_model(self.target_dir, self.model_dtype, str(device), self.trust_remote_code).requires_grad_(False)
        return self.model

    def _rows(self, ids: torch.Tensor, lengths: torch.Tensor, device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(keep, aux [n, 3H], final [n, H]) of the padded ids' n real tokens (keep: their flat positions in (B*L) order),
        on the target's device, as a cache would give them back: stored in hidden.dtype, read as float32."""
        L = ids.shape[1]
        keep = (torch.arange(L) < lengths[:, None]).reshape(-1).nonzero().squeeze(1)
        model = self.load_target(device)
        where = next(model.parameters()).device
        keep = keep.to(where)
        with torch.no_grad(), TargetStates(model, self.capture, TrainingInputError) as target:  # no_grad: the rows feed a backward
            aux, final = target.states(ids.to(where), keep)
            stored = encode_rows(aux, final, self.storage)
        return keep, stored["aux_hidden"].float(), stored["final_hidden"].float()

    def to_device(self, refs: list[Sample], device, dtype=torch.float32) -> dict[str, torch.Tensor]:
        """What HiddenCache.batch returns for these refs (load() passes them through: the states come from the device):
        aux [B, L, 3H], final [B, L, H] (in dtype, zero padding), input_ids, loss_mask [B, L], lengths [B]."""
        ids, mask, lengths = self.tokens(refs)
        B, L = ids.shape
        keep, aux_rows, final_rows = self._rows(ids, lengths, device)
        H = final_rows.shape[-1]
        keep = keep.to(device)
        aux = torch.zeros(B * L, 3 * H, dtype=dtype, device=device).index_copy_(0, keep, aux_rows.to(device=device, dtype=dtype))
        final = torch.zeros(B * L, H, dtype=dtype, device=device).index_copy_(0, keep, final_rows.to(device=device, dtype=dtype))
        return padded_batch(aux.view(B, L, 3 * H), final.view(B, L, H), ids, mask, lengths, device)

    def non_finite(self, refs: list[Sample]) -> list[Sample]:
        """The refs whose target states (aux or final, rounded through hidden.dtype) hold a NaN or an infinity."""
        bad = []
        for ref in refs:
            ids, _, lengths = self.tokens([ref])
            _, aux, final = self._rows(ids, lengths, self.model.device)  # after a step: the target is loaded
            if not (bool(torch.isfinite(aux).all()) and bool(torch.isfinite(final).all())):
                bad.append(ref)
        return bad

    def not_finite_cause(self, path: str, ids: list[str]) -> str:
        return (
            f"the target's states of {', '.join(ids)} in {path} are not finite (hidden.mode online, the target in model.dtype "
            f"{self.model_dtype}): the target overflows on them; train with model.dtype float32, or leave these samples out"
        )
