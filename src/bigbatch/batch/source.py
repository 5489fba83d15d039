"""Where a loop's samples come from: a map-style dataset or an iterable one, resumable.
Both ``draw`` a global batch of any size and ``load`` a step's micro-batches collated."""

from __future__ import annotations

import functools
import inspect
import random
import sys
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset, default_collate
from torch.utils.data._utils.pin_memory import pin_memory

from .._checks import did_you_mean, whole_number
from .sampler import VariableBatchSampler, warn_repeats

__all__ = ["IterableSource", "MapSource", "make_source"]

#: what ``next`` gives an iterable that yields nothing
_NOTHING = object()


#: a rank's micro-batch seeds start ``rank << RANK_SEED_BITS`` past rank 0's (numpy's
#: 32-bit seed keeps them apart up to 4,096 ranks of 2^20 micro-batches a step)
RANK_SEED_BITS = 20


class MapSource:
    """A map-style dataset: every sample once per epoch, exact resume.

    One ``DataLoader`` loads only the current step's micro-batches (its workers never
    prefetch a step whose size is not decided); without workers they are read here, as it
    would read them, to save its iterator's per-step host operators.
    """

    def __init__(
        self,
        dataset: Dataset,
        *,
        shuffle: bool = True,
        seed: int = 0,
        weight_fn: Callable[[int], int] | None = None,
        loader_options: dict[str, Any] | None = None,
    ) -> None:
        self.dataset = dataset
        self.sampler = VariableBatchSampler(
            len(dataset),  # type: ignore[arg-type]
            shuffle=shuffle,
            seed=seed,
            weight_fn=weight_fn,
        )
        self.weight_fn = weight_fn
        self._options = loader_options or {}
        self._generator = torch.Generator().manual_seed(self.sampler.seed)  # (a numpy int too)
        self._loader: DataLoader | None = None
        self._plan: list[list[int]] = []

    @property
    def dataset_size(self) -> int:
        return self.sampler.dataset_size

    def draw(self, size: int) -> list[int]:
        """The next global batch, as dataset indices."""
        return self.sampler.take(size)

    def load(self, micro_batches: list[list[int]], rank: int = 0) -> Iterator[Any]:
        """This rank's micro-batches, collated."""
        dataset, options = self.dataset, self._options
        if type(dataset) is TensorDataset and "collate_fn" not in options:
            # one gather per tensor instead of a sample-by-sample read and a stack of
            # as many rows (the same micro-batch, in a fraction of the host's time)
            dataset, options = _TensorRows(dataset), {**options, "collate_fn": _as_is}
        if not options.get("num_workers", 0):
            collate = options.get("collate_fn") or default_collate
            pin = options.get("pin_memory", False) and torch.cuda.is_available()
            for indices in micro_batches:
                batch = collate(_fetch(dataset, indices))
                yield pin_memory(batch) if pin else batch
            return
        # each micro-batch read from a seed of the loop's generator: persistent workers
        # seeded once would carry their random state on unsaved, and a resumed run differ
        seed = int(torch.empty((), dtype=torch.int64).random_(generator=self._generator))
        # the generator is alike on every rank: each rank's reads from seeds of their own (a
        # rank's augmentations were every other's)
        seed += rank << RANK_SEED_BITS
        self._plan = [_Seeded(b, seed + i) for i, b in enumerate(micro_batches)]
        if self._loader is None:
            user_init = options.get("worker_init_fn")
            self._loader = DataLoader(
                _SeededReads(dataset, self.dataset),
                batch_sampler=_CurrentPlan(self),
                # its workers' base seeds, unsaved: the reads are seeded from the plan
                generator=torch.Generator().manual_seed(self.sampler.seed),
                **{**options, "worker_init_fn": functools.partial(_show_users, user_init)},
            )
        yield from self._loader

    def close(self) -> None:  # the loader's persistent workers end (a closed loop reads no more)
        loader, self._loader = self._loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def state_dict(self) -> dict[str, Any]:
        return {"sampler": self.sampler.state_dict(), "loader_rng": self._generator.get_state()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self.sampler.load_state_dict(state["sampler"])
        self._generator.set_state(state["loader_rng"])

    def check_state(self, state: Any) -> None:
        """``ValueError`` where ``state`` is not one this source can load; nothing changed."""
        _check_keys(state, ("sampler", "loader_rng"), "a map-style dataset's")
        self.sampler.checked_state(state["sampler"])
        try:
            torch.Generator().set_state(state["loader_rng"])
        except (TypeError, RuntimeError) as error:
            raise ValueError(f"the saved loader_rng is not a generator's state: {error}") from None


class _TensorRows(Dataset):
    """A ``TensorDataset`` read a micro-batch at a time, collated as ``default_collate`` is."""

    def __init__(self, dataset: TensorDataset) -> None:
        self.tensors = dataset.tensors

    def __getitem__(self, index: int) -> tuple:
        return tuple(t[index] for t in self.tensors)

    def __getitems__(self, indices: list[int]) -> list:
        rows = torch.as_tensor(indices)
        return [t[rows] for t in self.tensors]

    def __len__(self) -> int:
        return len(self.tensors[0])


def _as_is(batch: Any) -> Any:
    return batch


def _fetch(dataset: Dataset, indices: list[int]) -> Any:
    """The samples at ``indices``, as a ``DataLoader`` without workers fetches them."""
    many = getattr(dataset, "__getitems__", None)
    return many(indices) if many is not None else [dataset[i] for i in indices]


class _CurrentPlan:
    """The DataLoader's batch sampler: the current step's micro-batches, nothing beyond."""

    def __init__(self, source: MapSource) -> None:
        # (weakly: the source holds the loader, whose persistent workers a cycle would keep
        # alive until a garbage collection)
        self._source = weakref.ref(source)

    def __iter__(self) -> Iterator[list[int]]:
        source = self._source()
        return iter(list(source._plan) if source is not None else [])

    def __len__(self) -> int:
        source = self._source()
        return len(source._plan) if source is not None else 0


class _Seeded(list):
    # a micro-batch's indices, with the seed its samples are read from

    def __init__(self, indices: list[int], seed: int) -> None:
        super().__init__(indices)
        self.seed = seed

    def __reduce__(self):  # to a worker: the seed with the indices
        return _Seeded, (list(self), self.seed)


def _show_users(user_init: Callable[[int], None] | None, worker_id: int) -> None:
    # a worker's get_worker_info().dataset is the user's dataset, not the reads' wrapper: a
    # worker_init_fn opens its file handles on it (torch's recipe), which the wrapper reads
    # through; WorkerInfo refuses assignment once built
    info = torch.utils.data.get_worker_info()
    object.__setattr__(info, "dataset", info.dataset.users)
    if user_init is not None:
        user_init(worker_id)


class _SeededReads(Dataset):
    """A dataset whose micro-batch reads start from their seed (torch, ``random``, numpy)."""

    def __init__(self, dataset: Dataset, users: Dataset) -> None:
        self.dataset = dataset
        self.users = users  # the dataset the user gave (a TensorDataset's rows read faster)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> Any:
        seed = getattr(indices, "seed", None)
        if seed is not None:
            torch.manual_seed(seed)
            random.seed(seed)
            if "numpy" in sys.modules:
                sys.modules["numpy"].random.seed(seed % 2**32)
        return _fetch(self.dataset, list(indices))

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getattr__(self, name: str) -> Any:  # a worker_init_fn reads the user's dataset
        if name in ("dataset", "users"):  # (unpickled in a worker before its state is set)
            raise AttributeError(name)
        return getattr(self.dataset, name)


class IterableSource:
    """An ``IterableDataset``, consumed in order and restarted when it ends; resume is exact
    only for an iterable that yields the same sequence each time."""

    dataset_size = None
    weight_fn = None

    def __init__(self, dataset: IterableDataset, collate_fn: Callable | None = None) -> None:
        self.dataset = dataset
        self.collate = collate_fn or torch.utils.data.default_collate
        self._iterator: Iterator[Any] | None = None
        self._consumed = 0
        self._drawn: list[Any] = []
        self._warned_repeats = False

    def draw(self, size: int) -> list[int]:
        if self._iterator is None:
            self._iterator = iter(self.dataset)
            for _ in range(self._consumed):  # resume: skip what was consumed
                next(self._iterator)
        samples = []
        for _ in range(size):
            try:
                samples.append(next(self._iterator))
            except StopIteration:  # a finite iterable: start it again
                if 0 < self._consumed < size and not self._warned_repeats:  # one pass: _consumed
                    self._warned_repeats = True
                    warn_repeats(size, self._consumed)
                self._iterator = iter(self.dataset)
                self._consumed = 0
                first = next(self._iterator, _NOTHING)
                if first is _NOTHING:
                    raise ValueError(
                        f"the iterable dataset {type(self.dataset).__name__} yielded no "
                        "samples (started again after it ran out): nothing to train on"
                    ) from None
                samples.append(first)
            self._consumed += 1  # since the iterable (last) started
        self._drawn = samples
        return list(range(len(samples)))

    def load(self, micro_batches: list[list[int]], rank: int = 0) -> Iterator[Any]:
        for batch in micro_batches:
            yield self.collate([self._drawn[i] for i in batch])

    def state_dict(self) -> dict[str, Any]:
        return {"consumed": self._consumed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.check_state(state)
        self._consumed = int(state["consumed"])
        self._iterator = None

    def check_state(self, state: Any) -> None:
        """``ValueError`` where ``state`` is not one this source can load."""
        _check_keys(state, ("consumed",), "an iterable dataset's")
        whole_number("the saved consumed", state["consumed"])


def _check_keys(state: Any, keys: tuple[str, ...], kind: str) -> None:
    missing = [k for k in keys if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"the saved source is not {kind} (it lacks {', '.join(missing)}): was it saved "
            "with another kind of dataset?"
        )


def make_source(
    dataset: Dataset | IterableDataset,
    *,
    shuffle: bool,
    seed: int,
    weight_fn: Callable[[int], int] | None,
    loader_options: dict[str, Any],
) -> MapSource | IterableSource:
    """The source for ``dataset``: iterable or map-style."""
    check_loader_options(loader_options)
    if isinstance(dataset, IterableDataset):
        if weight_fn is not None:
            raise ValueError("weight_fn needs a map-style dataset (samples are weighed by index)")
        unused = [k for k, v in loader_options.items() if k != "collate_fn" and v]
        if unused:
            warnings.warn(
                f"an iterable dataset is read in this process, in order: loader_options "
                f"{', '.join(unused)} are not used (only collate_fn is)",
                stacklevel=3,
            )
        return IterableSource(dataset, loader_options.get("collate_fn"))
    if not (hasattr(dataset, "__getitem__") and hasattr(dataset, "__len__")):
        raise TypeError(
            f"dataset must be a map-style dataset (with __getitem__ and __len__) or an "
            f"IterableDataset, got {type(dataset).__name__}"
        )
    try:  # torch's own rules (prefetch_factor without workers ...), at once, not at a step
        DataLoader([0], **loader_options)
    except ValueError as error:
        raise ValueError(f"loader_options: {error}") from None
    return MapSource(
        dataset, shuffle=shuffle, seed=seed, weight_fn=weight_fn, loader_options=loader_options
    )


#: ``DataLoader`` keywords the source sets itself: the loop decides the batches, their order
#: and the seed of the loader's workers
SET_BY_THE_LOOP = (
    "dataset",
    "batch_size",
    "shuffle",
    "sampler",
    "batch_sampler",
    "drop_last",
    "generator",
    "in_order",  # out of order, the i-th backward would carry another micro-batch's weight
)


def check_loader_options(options: dict[str, Any]) -> None:
    """A ``TypeError`` naming a key ``DataLoader`` does not take or the loop sets itself."""
    taken = set(inspect.signature(DataLoader).parameters) - set(SET_BY_THE_LOOP)
    for key in options:
        if key in SET_BY_THE_LOOP:
            raise TypeError(f"loader_options[{key!r}]: the loop sets it (it draws every batch)")
        if key not in taken:
            raise TypeError(
                f"loader_options[{key!r}] is not a DataLoader keyword{did_you_mean(key, taken)}"
            )
