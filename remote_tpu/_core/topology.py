"""Accelerator names -> slice shape, following Cloud TPU's own naming.

Sources (Cloud TPU documentation, "System architecture" and each version's page):

- https://cloud.google.com/tpu/docs/v2 and /v3: a v2/v3 accelerator type counts
  TensorCores, 2 per chip; a host (TPU VM) has 4 chips (8 cores). Slices: v2-8,
  v2-32, v2-128, v2-256, v2-512; v3-8, v3-32, v3-64, v3-128, v3-256, v3-512,
  v3-1024, v3-2048.
- https://cloud.google.com/tpu/docs/v4: the number counts TensorCores, 2 per chip
  (one megacore JAX device per chip), 4 chips per host; slices are 3D shapes of
  whole hosts, from v4-8 (2x2x1) to the full pod of 4096 chips (v4-8192).
- https://cloud.google.com/tpu/docs/v5p: the number counts TensorCores, 2 per chip
  (one JAX device per chip), 4 chips per host, from v5p-8 (2x2x1) up to the
  largest schedulable shape 16x16x24 (6144 chips, v5p-12288).
- https://cloud.google.com/tpu/docs/v5e: v5e (`v5litepod-N`) counts chips, one
  TensorCore each; v5litepod-1, -4 and -8 are one host, larger slices (16, 32, 64,
  128, 256) have 4 chips per host.
- https://cloud.google.com/tpu/docs/v6e: v6e counts chips like v5e, with the same
  sizes (1, 4, 8 on one host; 16 to 256 with 4 chips per host).
- https://cloud.google.com/tpu/docs/tpu7x: TPU7x (Ironwood, GKE only) is named
  ``tpu7x-N``, N counting TensorCores, 2 per chip, each its own JAX device (the
  dual-chiplet programming model: two devices per chip); a VM has 4 chips
  (2x2x1), slices are 3D shapes of whole VMs up to the 9216-chip pod. GKE runs
  two JAX processes per VM, one per NUMA node
  (https://cloud.google.com/kubernetes-engine/docs/concepts/tpu-ironwood).

GKE's node labels for each generation (``gke_accelerator``) are those of
https://cloud.google.com/kubernetes-engine/docs/concepts/plan-tpus; v2 and v3
are not offered there.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence

from .exceptions import ConfigurationError


@dataclasses.dataclass(frozen=True)
class _Generation:
    name: str                 # as in the accelerator type: "v5litepod"
    counts: str               # "tensorcores" or "chips": what the number means
    cores_per_chip: int
    devices_per_chip: int     # JAX devices per chip (v2/v3 expose each core)
    chips_per_host: int       # on a multi-host slice
    single_host_max_chips: int
    sizes: tuple[int, ...] = ()   # explicit documented sizes, or ...
    step: int = 0                 # ... every multiple of step up to max_size
    max_size: int = 0
    torus_3d: bool = False        # chips form a 3D torus (else a 2D one)
    gke_accelerator: str = ""     # cloud.google.com/gke-tpu-accelerator; "" = not on GKE
    processes_per_host: int = 1   # JAX processes GKE runs on each VM

    def accelerator(self, n: int) -> str:
        """Cloud's own name: tpu-v5p-32 (the prefix is ours), tpu7x-32 (its own)."""
        return f"{self.name}-{n}" if self.name.startswith("tpu") else f"tpu-{self.name}-{n}"

    def valid(self, n: int) -> bool:
        if self.sizes:
            return n in self.sizes
        return n >= self.step and n % self.step == 0 and n <= self.max_size

    def nearest(self, n: int) -> list[int]:
        if self.sizes:
            below = [s for s in self.sizes if s < n][-1:]
            above = [s for s in self.sizes if s > n][:1]
            return below + above
        lo = (n // self.step) * self.step
        out = [s for s in (lo, lo + self.step) if self.step <= s <= self.max_size]
        return out or [self.step]

    def forms(self) -> str:
        if self.sizes:
            return ", ".join(str(s) for s in self.sizes)
        return f"any multiple of {self.step} from {self.step} to {self.max_size}"


_GENERATIONS = {
    g.name: g
    for g in (
        _Generation("v2", "tensorcores", 2, 2, 4, 4, sizes=(8, 32, 128, 256, 512)),
        _Generation("v3", "tensorcores", 2, 2, 4, 4,
                    sizes=(8, 32, 64, 128, 256, 512, 1024, 2048)),
        _Generation("v4", "tensorcores", 2, 1, 4, 4, step=8, max_size=8192, torus_3d=True,
                    gke_accelerator="tpu-v4-podslice"),
        _Generation("v5p", "tensorcores", 2, 1, 4, 4, step=8, max_size=12288, torus_3d=True,
                    gke_accelerator="tpu-v5p-slice"),
        _Generation("v5litepod", "chips", 1, 1, 4, 8,
                    sizes=(1, 4, 8, 16, 32, 64, 128, 256),
                    gke_accelerator="tpu-v5-lite-podslice"),
        _Generation("v6e", "chips", 1, 1, 4, 8, sizes=(1, 4, 8, 16, 32, 64, 128, 256),
                    gke_accelerator="tpu-v6e-slice"),
        _Generation("tpu7x", "tensorcores", 2, 2, 4, 4, step=8, max_size=18432,
                    torus_3d=True, gke_accelerator="tpu7x", processes_per_host=2),
    )
}
_ALIASES = {"v5e": "v5litepod", "v5lite": "v5litepod"}
_PATTERN = re.compile(r"^(?:tpu-)?(v\d+[a-z]*|tpu7x)-(\d+)$")
_EXAMPLES = ("tpu-v4-16, tpu-v5p-32, tpu-v5litepod-16 (alias tpu-v5e-16), tpu-v6e-8, "
             "tpu7x-32")


# The chips of one TPU host as a 2D grid (4 chips: 2x2; 8 chips: 2x4).
# https://cloud.google.com/tpu/docs/v4, /v5p and /tpu7x: a host is 2x2x1 chips;
# https://cloud.google.com/tpu/docs/v5e and /v6e: 2x2 (4 chips) or 2x4 (8 chips).
HOST_GRID = {1: (1, 1), 2: (1, 2), 4: (2, 2), 8: (2, 4)}

Bounds = tuple[int, int, int]


def chip_shape(chips: int, generation: str, host: tuple[int, int]) -> Bounds:
    """The default chip topology of a multi-host slice of ``chips`` chips.

    https://cloud.google.com/tpu/docs/types-topologies: "the default topology
    associated with a given chip count is the one that's most similar to a cube";
    a v4 (and v5p) topology is AxBxC with A <= B <= C, all <= 4 or all multiples
    of 4. That rule gives every documented shape: v4/v5p 2x2x2 (16 cores),
    2x2x4 (32), 2x4x4 (64), 4x4x4 (128), 4x4x8 (256), ..., 16x16x24
    (https://cloud.google.com/tpu/docs/v5p; TPU7x's are the same shapes,
    https://cloud.google.com/tpu/docs/tpu7x); v5e/v6e 4x4, 4x8, 8x8, 8x16, 16x16
    (https://cloud.google.com/tpu/docs/v5e); v2/v3 host grids 2x2 (v2-32), 2x4
    (v3-64) ... 16x16 (v3-2048), as torch_xla's _ACCELERATOR_TYPE_TO_HOST_BOUNDS.
    Whole hosts tile the slice: A and B are multiples of the host's grid.
    """
    hx, hy = host
    shapes: list[Bounds] = []       # (A, B, C), A <= B <= C (2D: C = 1, A <= B)
    if _GENERATIONS[generation].torus_3d:
        for a in range(hx, chips + 1, hx):
            if a * a * a > chips:
                break
            if chips % a:
                continue
            rest = chips // a
            first_b = -(-a // hy) * hy          # the least multiple of hy that is >= a
            shapes += [(a, b, rest // b) for b in range(first_b, math.isqrt(rest) + 1, hy)
                       if rest % b == 0]
        documented = [s for s in shapes
                      if all(d <= 4 for d in s) or all(d % 4 == 0 for d in s)]
        shapes = documented or shapes
    else:
        shapes = [(a, chips // a, 1) for a in range(hx, math.isqrt(chips) + 1, hx)
                  if chips % a == 0 and (chips // a) % hy == 0]
    if not shapes:
        raise ValueError(f"{chips} chips cannot be tiled by hosts of {hx}x{hy} chips")
    # Most like a cube (a square in 2D): least longest side over shortest (s[0]).
    return min(shapes, key=lambda s: (max(s) / s[0], s))


@dataclasses.dataclass(frozen=True)
class Topology:
    """The shape of one TPU slice, parsed from an accelerator name.

    >>> t = Topology.parse("tpu-v5p-32")
    >>> (t.chips, t.tensorcores, t.hosts, t.chips_per_host, t.multi_host)
    (16, 32, 4, 4, True)
    """

    name: str             # canonical accelerator name, e.g. "tpu-v5p-32", "tpu7x-32"
    generation: str       # "v2", "v3", "v4", "v5p", "v5litepod", "v6e" or "tpu7x"
    chips: int
    tensorcores: int
    hosts: int
    chips_per_host: int
    devices_per_host: int  # JAX devices each host's process sees

    @property
    def multi_host(self) -> bool:
        return self.hosts > 1

    @property
    def devices(self) -> int:
        return self.devices_per_host * self.hosts

    @property
    def torus_3d(self) -> bool:
        return _GENERATIONS[self.generation].torus_3d

    @property
    def chip_bounds(self) -> Bounds:
        """The slice's default chip topology: ``tpu-v5p-32`` -> (2, 2, 4),
        ``tpu-v6e-16`` -> (4, 4, 1), ``tpu-v6e-8`` -> (2, 4, 1)."""
        grid = HOST_GRID.get(self.chips_per_host, (1, self.chips_per_host))
        if self.hosts == 1:
            return (grid[0], grid[1], 1)
        return chip_shape(self.chips, self.generation, grid)

    @property
    def topology_label(self) -> str:
        """The chip topology as GKE and Cloud TPU write it: ``2x2x4``, ``4x4``."""
        bounds = self.chip_bounds
        return "x".join(str(d) for d in (bounds if self.torus_3d else bounds[:2]))

    @property
    def gke_accelerator(self) -> str:
        """GKE's ``cloud.google.com/gke-tpu-accelerator`` value; "" where GKE
        offers no such slice (v2, v3)."""
        return _GENERATIONS[self.generation].gke_accelerator

    @property
    def gke_processes_per_host(self) -> int:
        """The JAX processes GKE runs on each VM of this generation (TPU7x: 2)."""
        return _GENERATIONS[self.generation].processes_per_host

    def check_host_count(self, addresses: Sequence[str], where: str, advice: str = (
            "Use the accelerator the slice really is, or list every host of the slice "
            "(first = gateway), or give only the gateway's address.")) -> None:
        """The one check that a slice's host list fits this accelerator; ``advice``
        says what the one who made the list can do about it."""
        if len(addresses) != self.hosts:
            raise ConfigurationError(
                f"{self.name} has {self.hosts} host(s), but {where} lists "
                f"{len(addresses)}: {', '.join(addresses)}. {advice}")

    def check_same(self, actual: str, where: str) -> None:
        """The one check that a slice's own accelerator type is this one."""
        other = Topology.parse(actual)
        if other.name != self.name:
            raise ConfigurationError(
                f"asked for {self.name}, {self.hosts} host(s); {where} is {other.name}, "
                f"{other.hosts} host(s). Use accelerator={other.name!r}.")

    @classmethod
    def parse(cls, accelerator: str) -> Topology:
        """Parse ``"tpu-v5p-32"`` (the ``tpu-`` prefix is optional)."""
        if isinstance(accelerator, Topology):
            return accelerator
        if not isinstance(accelerator, str):
            raise ConfigurationError(
                f"accelerator must be a string such as 'tpu-v5p-32', got "
                f"{type(accelerator).__name__} {accelerator!r}")
        m = _PATTERN.match(accelerator.strip().lower())
        if not m:
            raise ConfigurationError(
                f"accelerator {accelerator!r} is not of the form 'tpu-<version>-<size>'; "
                f"for example {_EXAMPLES}. Versions: {', '.join(sorted(_GENERATIONS))}.")
        gen_name = _ALIASES.get(m.group(1), m.group(1))
        size = int(m.group(2))
        gen = _GENERATIONS.get(gen_name)
        if gen is None:
            raise ConfigurationError(
                f"accelerator {accelerator!r}: unknown TPU version {m.group(1)!r}; "
                f"known versions are {', '.join(sorted(_GENERATIONS))} "
                f"(v5e is written v5litepod or v5e; Ironwood is tpu7x-N, N TensorCores).")
        if not gen.valid(size):
            near = " or ".join(gen.accelerator(s) for s in gen.nearest(size))
            raise ConfigurationError(
                f"accelerator {accelerator!r}: {size} is not a valid {gen.name} size "
                f"(the number counts {gen.counts}). Valid sizes: {gen.forms()}. "
                f"Nearest valid: {near}.")
        if gen.counts == "tensorcores":
            chips = size // gen.cores_per_chip
        else:
            chips = size
        if chips <= gen.single_host_max_chips:
            hosts, per_host = 1, chips
        else:
            hosts, per_host = chips // gen.chips_per_host, gen.chips_per_host
        return cls(
            name=gen.accelerator(size),
            generation=gen.name,
            chips=chips,
            tensorcores=chips * gen.cores_per_chip,
            hosts=hosts,
            chips_per_host=per_host,
            devices_per_host=per_host * gen.devices_per_chip,
        )
