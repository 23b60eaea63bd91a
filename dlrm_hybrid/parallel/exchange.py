"""What the tables' owners send back after the lookup: pooled vectors, or partial results.

`pooled` is torchrec's sharded EmbeddingBagCollection as it is: its output all-to-all sends each
sample's pooled vectors to the sample's rank.

`des` is distributed equivalent substitution (Rong et al., SIGIR 2020). When the first operation
on the pooled vectors is linear in them, each owner applies its share of it to the vectors it
has just looked up, for the whole global batch, and one reduce-scatter adds the owners' shares
up on each sample's rank:
- `cat`: z = sum_t W_t e_t, the first top layer's product with the pooled vectors ([B, H]);
  the sample's rank adds W_dense x + b.
- `fm`: [sum_t e_t, sum_t ||e_t||^2, sum_t w_t] ([B, D + 2], interactions.FactorizationMachine).
Column-wise shards take part like whole tables: their shares of these sums add up too.

How it is built, and why:
- The id all-to-all and the fused lookups stay torchrec's. Only the sharded collection's
  `compute_and_output_dist` is replaced, on the instance: the lookups as torchrec runs them,
  then the partial products and torchrec's `PooledEmbeddingsReduceScatter` (autograd: its
  backward is the all-gather that sends each owner the gradient of its partial result; it also
  takes the quantized-comms codecs) in place of the output all-to-all. torchrec's own train
  pipeline calls that method, so pipelining works unchanged. torchrec's EmbeddingTower sharding
  was the other candidate: it co-locates a tower's tables with an interaction module but still
  all-to-alls the tower's output to the samples' ranks, needs its tables grouped per tower on
  one rank (not our placement, no column-wise shards), and the towers' outputs are not summed.
- `cat`'s W_t stay where they were: columns of the top MLP's first weight, on every rank, so the
  model, its checkpoints and the dense optimizer are the same for both paths. That weight leaves
  DDP: its bottom-MLP columns are all-reduced by a gradient hook, its W_t columns are trained
  only by the tables' owners, which see the whole global batch's gradient (divided by P, as
  DDP's mean would be), and nobody all-reduces them. The copies elsewhere go stale;
  `make_replicas_current` brings every rank's copy (and its optimizer state) up to date with one
  all-reduce before a checkpoint is written, so a checkpoint of either path loads into the other.
"""

from __future__ import annotations

from typing import Callable, Dict, List, Optional, Tuple

import torch
import torch.distributed as dist
from torchrec.distributed.comm_ops import get_gradient_division
from torchrec.distributed.dist_data import PooledEmbeddingsReduceScatter
from torchrec.distributed.fbgemm_qcomm_codec import CommOp
from torchrec.distributed.sharding.dp_sharding import DpPooledEmbeddingSharding
from torchrec.distributed.types import Awaitable, LazyAwaitable
from torchrec.sparse.jagged_tensor import KeyedTensor

from dlrm_hybrid.model.compositional import FeatureLookup
from dlrm_hybrid.model.dlrm import DLRM
from dlrm_hybrid.model.interactions import FactorizationMachine
from dlrm_hybrid.parallel.exchange_bytes import value_bytes


class ExchangeCounter:
    """Bytes this rank hands to the exchange's collectives to send to other ranks, forward and
    backward, counted from the tensors themselves as training steps run (not in evaluation)."""

    def __init__(self, world_size: int, comm_precision: str) -> None:
        self.world, self.value_bytes = world_size, value_bytes(comm_precision)
        self.forward = self.backward = 0
        self.path = "pooled"  # the exchange installed (install_exchange)

    def take(self, steps: int) -> Dict[str, float | str]:
        """The exchange installed and its per-step means over the `steps` steps since the
        last call."""
        out: Dict[str, float | str] = {
            "exchange": self.path, "exchange_fwd_bytes": self.forward / max(steps, 1),
            "exchange_bwd_bytes": self.backward / max(steps, 1)}
        self.forward = self.backward = 0
        return out

    def sent_rows_of_others(self, tensor: torch.Tensor) -> None:
        """Forward: a [P * B, cols] tensor of which the other ranks' P - 1 blocks leave."""
        rows, cols = tensor.shape
        self.forward += (rows - rows // self.world) * cols * self.value_bytes

    def on_gradient(self, tensor: torch.Tensor, own_cols: int = 0, copies: int = 1) -> None:
        """Backward: `copies` times this [B, cols] tensor's gradient leaves, less `own_cols`."""
        if tensor.requires_grad:
            tensor.register_hook(lambda grad: self._add_backward(grad, own_cols, copies))

    def _add_backward(self, grad: torch.Tensor, own_cols: int, copies: int) -> None:
        self.backward += copies * grad.shape[0] * (grad.shape[1] - own_cols) * self.value_bytes


def install_exchange(dmp, path: str, world_size: int, comm_precision: str,
                     codecs: Optional[dict]) -> None:
    """Make the sharded model exchange by `path` (pooled | des), counting the bytes it sends
    (`model.exchange_counter`)."""
    model: DLRM = dmp.module
    ebc = model.embedding_bags
    counter = ExchangeCounter(world_size, comm_precision)
    model.exchange_counter = counter
    if path == "pooled":
        _count_pooled(ebc, counter)
    else:
        _PartialExchange(model, ebc, world_size, counter, codecs)
        model.exchange = counter.path = "des"


def _count_pooled(ebc, counter: ExchangeCounter) -> None:
    """Hooks on torchrec's output all-to-alls: each gets the owner's [P * B, cols] vectors.
    Replicated (data_parallel) tables send nothing: their output "dist" hands each rank its
    own samples' vectors (their gradients are all-reduced by DDP, not exchanged)."""
    for sharding, output_dist in zip(ebc._embedding_shardings, ebc._output_dists):
        if isinstance(sharding, DpPooledEmbeddingSharding):
            continue
        own = {"cols": 0}

        def before(module, args, own=own):
            if torch.is_grad_enabled():
                counter.sent_rows_of_others(args[0])
                own["cols"] = args[0].shape[1]

        def after(module, args, awaitable, own=own):
            if torch.is_grad_enabled():
                awaitable.callbacks.append(lambda out: _then(counter.on_gradient, out, own["cols"]))
            return awaitable

        output_dist.register_forward_pre_hook(before)
        output_dist.register_forward_hook(after)


def _then(hook: Callable, tensor: torch.Tensor, *args) -> torch.Tensor:
    hook(tensor, *args)
    return tensor


def local_columns(ebc, index: int, rank: int) -> List[Tuple[str, int]]:
    """(lookup key, column of its vector) of each column the rank's lookup of sharding type
    `index` returns, in order: its grouped tables' keys, each as wide as its shard."""
    columns = []
    for group in ebc._embedding_shardings[index]._grouped_embedding_configs_per_rank[rank]:
        for key, width, shard in zip(group.embedding_names(), group.embedding_dims(),
                                     group.embedding_shard_metadata()):
            first = shard.shard_offsets[1] if shard is not None else 0
            columns += [(key, first + c) for c in range(width)]
    return columns


def key_positions(lookups: List[FeatureLookup]) -> Dict[str, Tuple[int, int, bool]]:
    """Lookup key -> (feature index, where its columns start in the feature's vector,
    whether it is a first-order table): 0, or D/2 for a `concat` feature's second part."""
    positions = {}
    for f, lookup in enumerate(lookups):
        for part_index, part in enumerate(lookup.parts):
            start = part_index * part.dim if lookup.operation == "concat" else 0
            positions.update({key: (f, start, False) for key in part.keys})
        if lookup.first_order:
            positions[lookup.first_order.keys[0]] = (f, 0, True)
    return positions


class _PartialExchange:
    """The des path, installed on a sharded collection (see the module docstring)."""

    def __init__(self, model: DLRM, ebc, world_size: int, counter: ExchangeCounter,
                 codecs: Optional[dict]) -> None:
        self.ebc, self.world, self.counter = ebc, world_size, counter
        rank = dist.get_rank()
        positions = key_positions(model.lookups)
        device = model.first_top_layer().weight.device
        columns = [local_columns(ebc, i, rank) for i in range(len(ebc._lookups))]
        if isinstance(model.interaction, FactorizationMachine):
            self.partials = [_FmShare(cols, positions, model.embedding_dim, device) for cols in columns]
            self.width = model.embedding_dim + 2
        else:
            layer = model.first_top_layer()
            dense = layer.in_features - len(model.lookups) * model.embedding_dim
            self.partials = [_CatShare(cols, positions, layer.weight, dense, model.embedding_dim,
                                       device) for cols in columns]
            self.width = layer.out_features
            _average_first_layer_gradient(layer.weight, dense, world_size)
            owned = [c for share in self.partials for c in share.owned]
            self.make_replicas_current = lambda optimizer: _current_columns(
                layer.weight, optimizer, owned, dense)
            model.partial_exchange = self
        codec = (codecs or {}).get(CommOp.POOLED_EMBEDDINGS_REDUCE_SCATTER.name)
        self.reduce_scatter = PooledEmbeddingsReduceScatter(dist.group.WORLD, codec)
        ebc.compute_and_output_dist = self.compute_and_exchange

    def compute_and_exchange(self, ctx, dist_input) -> LazyAwaitable[KeyedTensor]:
        partial = None
        for lookup, features, share in zip(self.ebc._lookups, dist_input, self.partials):
            looked_up = lookup(features)
            share.check(looked_up)
            with torch.autocast(looked_up.device.type, enabled=False):
                part = share(looked_up.float())
            partial = part if partial is None else partial + part
        assert partial is not None, "des: the sharded collection has no lookups"
        training = torch.is_grad_enabled()
        if training:
            # A rank that owns nothing of any table must still run the backward all-gather.
            if not partial.requires_grad:
                partial.requires_grad_()
            self.counter.sent_rows_of_others(partial)
        return _PartialSums(self.reduce_scatter(partial), self.width,
                            self.counter if training else None, self.world)


class _PartialSums(LazyAwaitable[KeyedTensor]):
    """The reduce-scatter's result as the one-key KeyedTensor the model reads."""

    def __init__(self, summed: Awaitable[torch.Tensor], width: int,
                 counter: Optional[ExchangeCounter], world: int) -> None:
        super().__init__()
        self.summed, self.width, self.counter, self.world = summed, width, counter, world

    def _wait_impl(self) -> KeyedTensor:
        values = self.summed.wait()
        if self.counter is not None:  # backward: the all-gather sends it to the P - 1 others
            self.counter.on_gradient(values, copies=self.world - 1)
        return KeyedTensor(keys=["partial_sums"], length_per_key=[self.width], values=values)


class _Share(torch.nn.Module):
    """An owner's share of the partial sums, from its lookup's [P * B, cols] vectors."""

    def __init__(self, columns: List[Tuple[str, int]]) -> None:
        super().__init__()
        self.columns = columns

    def check(self, looked_up: torch.Tensor) -> None:
        if looked_up.shape[1] != len(self.columns):
            raise RuntimeError(f"des: the lookup returned {looked_up.shape[1]} columns where "
                               f"its sharding lists {len(self.columns)}: torchrec's layout "
                               f"changed; use parallel.exchange=pooled")


class _CatShare(_Share):
    """sum_t W_t e_t over this rank's columns: [P * B, cols] @ W[:, those columns]^T."""

    def __init__(self, columns, positions, weight: torch.nn.Parameter, dense: int, dim: int,
                 device: torch.device) -> None:
        super().__init__(columns)
        self.weight = weight
        self.owned = [dense + positions[k][0] * dim + positions[k][1] + c for k, c in columns]
        self.register_buffer("index", torch.tensor(self.owned, dtype=torch.long, device=device),
                             persistent=False)

    def forward(self, looked_up: torch.Tensor) -> torch.Tensor:
        return looked_up @ self.weight.index_select(1, self.index).float().t()


class _FmShare(_Share):
    """[sum e_t, sum ||e_t||^2, sum w_t] over this rank's columns, as two 0/1 projections."""

    def __init__(self, columns, positions, dim: int, device: torch.device) -> None:
        super().__init__(columns)
        linear = torch.zeros(len(columns), dim + 2, device=device)
        squares = torch.zeros(len(columns), dim + 2, device=device)
        for j, (key, c) in enumerate(columns):
            _, start, first_order = positions[key]
            if first_order:
                linear[j, dim + 1] = float(c == 0)  # the weight; columns 1..3 are unused
            else:
                linear[j, start + c] = 1.0
                squares[j, dim] = 1.0
        self.register_buffer("linear", linear, persistent=False)
        self.register_buffer("squares", squares, persistent=False)

    def forward(self, looked_up: torch.Tensor) -> torch.Tensor:
        return looked_up @ self.linear + (looked_up * looked_up) @ self.squares


def _average_first_layer_gradient(weight: torch.nn.Parameter, dense: int, world: int) -> None:
    """What DDP did for the whole weight, for the part every rank trains: the bottom-MLP
    columns' gradients averaged over ranks. The W_t columns' gradient is the owner's sum over
    the global batch of the gradients the reduce-scatter's backward brought, which torchrec
    divides by P (`comm_ops.GRADIENT_DIVISION`, as it does for the pooled vectors): already
    the mean DDP would take; divided here only where that division is switched off."""
    if world == 1:
        return

    def average(param: torch.Tensor) -> None:
        grad = param.grad
        local = grad[:, :dense].contiguous()
        dist.all_reduce(local)
        grad[:, :dense] = local / world
        if not get_gradient_division():
            grad[:, dense:] /= world

    weight.register_post_accumulate_grad_hook(average)


def make_replicas_current(dmp, optimizer) -> None:
    """Before a checkpoint (collective): with des and `cat`, every rank's copy of the W_t
    columns, and their dense-optimizer state, from their owners. Nothing to do otherwise."""
    exchange = getattr(dmp.module, "partial_exchange", None)
    if exchange is not None:
        exchange.make_replicas_current(optimizer)


@torch.no_grad()
def _current_columns(weight: torch.Tensor, optimizer, owned: List[int], first: int) -> None:
    """One all-reduce per tensor of columns `first`.. of the weight (and of each optimizer
    state tensor shaped like it), each rank contributing the columns it owns and zeros."""
    tensors = [weight] + [t for t in optimizer.state.get(weight, {}).values()
                          if isinstance(t, torch.Tensor) and t.shape == weight.shape]
    mask = torch.zeros(weight.shape[1], 1, dtype=torch.bool, device=weight.device)
    mask[owned] = True
    mask = mask[first:].t()
    for tensor in tensors:
        block = torch.where(mask, tensor[:, first:], torch.zeros((), dtype=tensor.dtype,
                                                                 device=tensor.device))
        dist.all_reduce(block)
        tensor[:, first:] = block
