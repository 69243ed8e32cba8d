"""Global-memory bytes per element of a multi-tensor kernel, read off its PTX (no GPU needed).

Used by ``tests/kernels/aot_compile.py`` (``traffic`` mode) for ``tests/kernels/test_kernel_traffic.py``.

Every ``ld.global``/``st.global`` instruction moves ``vector count x element width`` bytes per thread
(``ld.global.v4.b32``: 16 B). What one chunk of ``BLOCK`` elements moves is found by evaluating each access's
address for every thread of the CTA (``%tid.x`` in ``0 .. 32 num_warps - 1``): addresses are tracked as a
*uniform* symbolic part (kernel parameters, values loaded from uniform addresses: the address table's entries,
the chunk map, ``numels``) plus a concrete per-thread offset. So an access moves
``(number of distinct per-thread addresses) x width`` bytes per chunk: replicated lanes (a ``[8]`` absmax vector
held by 512 threads) count once, and every lane of a 16-byte vector load counts 16 bytes.

Accesses are classified by their address:

* **data**: the base is an address loaded from the table row ``ptrs`` (``row_pointer``: params, grads, moments,
  model copies, split low halves, 8-bit codes and their absmax) and the offset varies per thread. These are the
  per-element bytes the table in docs/benchmarks.md reports and the test holds against each variant's count.
* **uniform**: the same address in every thread (the table entries themselves, ``numels``, the chunk map,
  hyper-parameters, flags, step counters, per-chunk partial sums, tickets): per chunk or per launch, not per
  element, and served by one transaction per warp; counted apart, never as data.
* **other**: per-thread addresses that are not table rows: data-dependent gathers (the 8-bit code book, 2 KiB,
  L1-resident), the scratch partials a finishing program sums (per tensor, not per element).

Control flow: the chunk loop is the LLVM loop (``// =>This Inner Loop Header: Depth=1``) holding the most data
accesses; its blocks form a DAG once back edges are removed, and the bytes of every path from the header to a
latch are summed. A kernel's data accesses sit on either side of two kinds of branches: a chunk wholly inside
its tensor (unmasked, vectorized) or its tail (masked, scalar), which move the same bytes; and, with 8-bit
moments, a tensor whose state is 8-bit or fp32 (below ``state8.SMALL_NUMEL``). So the *fewest* bytes of any
path are the variant's bytes per element (8-bit state where it has one) and the *most* the worst path (8-bit
kernels: a small tensor's fp32 moments). ``v4``: the data accesses that are 16-byte vectors.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field

import numpy as np

_INSTR_SPLIT = re.compile(r";")
_REG = re.compile(r"%[a-z]+\d*|%[a-z]+\.[xyz]")
_MEM = re.compile(r"\[\s*(%\w+)\s*(?:\+\s*(-?\d+))?\s*\]")
_BLOCK_LABEL = re.compile(r"^\$L__BB(\d+)_(\d+):")
_BLOCK_COMMENT = re.compile(r"^//\s*%bb\.(\d+):")
_IN_LOOP = re.compile(r"in Loop: Header=BB\d+_(\d+) Depth=(\d+)")
_PARENT = re.compile(r"Parent Loop BB\d+_(\d+) Depth=(\d+)")
_HEADER = re.compile(r"Loop Header: Depth=(\d+)")
_WIDTH = re.compile(r"\.(?:b|u|s|f)(\d+)$")


@dataclass
class Access:
    """One global memory instruction."""

    block: int
    store: bool
    width: int  # bytes per thread
    vector: int  # lanes of the vector access (1, 2, 4)
    kind: str  # "data", "uniform", "other"
    distinct_bytes: int  # bytes per CTA: distinct per-thread addresses x width
    text: str


@dataclass
class Block:
    num: int
    instrs: list[str] = field(default_factory=list)
    loops: set[int] = field(default_factory=set)  # headers of the loops (any depth) the block is in
    header_depth: int | None = None
    succ: list[int] = field(default_factory=list)


class _Sym:
    """A uniform opaque value (``table``: derived from an entry of the address table)."""

    __slots__ = ("name", "table")

    def __init__(self, name: str, table: bool) -> None:
        self.name, self.table = name, table


@dataclass(frozen=True)
class _Aff:
    """``sum(coef * sym) + off[tid]``: symbols uniform across threads, ``off`` concrete per thread."""

    terms: tuple  # ((sym, coef), ...)
    off: np.ndarray = field(compare=False)

    @property
    def table(self) -> bool:
        return any(s.table for s, _ in self.terms)

    @property
    def uniform(self) -> bool:
        return bool((self.off == self.off[0]).all())

    @property
    def concrete(self) -> bool:
        return not self.terms


NU = None  # a per-thread value the analysis cannot follow (loaded data and what is computed from it)


def _merge(a: tuple, b: tuple, scale_b: int = 1) -> tuple:
    out: dict = {}
    for s, c in a:
        out[s] = out.get(s, 0) + c
    for s, c in b:
        out[s] = out.get(s, 0) + c * scale_b
    return tuple((s, c) for s, c in out.items() if c)


def _split_blocks(ptx: str) -> list[Block]:
    body = ptx[ptx.index(".entry"):]
    body = body[body.index("{") + 1:]
    blocks: list[Block] = []
    cur: Block | None = None
    for raw in body.splitlines():
        line = raw.strip()
        code = line.partition("//")[0]
        code = code.strip()
        m = _BLOCK_LABEL.match(code) or (_BLOCK_COMMENT.match(line) if not code else None)
        if m:
            num = int(m.group(m.lastindex))
            cur = Block(num)
            blocks.append(cur)
        if cur is None:
            if code and not code.startswith("."):
                cur = Block(0)
                blocks.append(cur)
            else:
                continue
        for pat in (_IN_LOOP, _PARENT):
            for h, _ in pat.findall(line):
                cur.loops.add(int(h))
        hm = _HEADER.search(line)
        if hm:
            cur.header_depth = int(hm.group(1))
            cur.loops.add(cur.num)
        if m:
            code = code[m.end():].strip() if _BLOCK_LABEL.match(code) else ""
        if not code or code.startswith((".", "$L__")) or code in ("{", "}"):
            continue
        for stmt in _INSTR_SPLIT.split(code):
            stmt = stmt.strip().strip("{}").strip()
            if stmt and not stmt.startswith("."):
                cur.instrs.append(stmt)
    return blocks


def _edges(blocks: list[Block]) -> None:
    for i, b in enumerate(blocks):
        nxt = blocks[i + 1].num if i + 1 < len(blocks) else None
        last = b.instrs[-1] if b.instrs else ""
        target = re.search(r"\bbra(?:\.uni)?\s+\$L__BB\d+_(\d+)", last)
        if target:
            b.succ.append(int(target.group(1)))
            if last.startswith("@") and nxt is not None:
                b.succ.append(nxt)
        elif last.startswith("ret") or last.startswith("exit"):
            pass
        elif nxt is not None:
            b.succ.append(nxt)


class _Eval:
    """Abstract evaluation of the PTX's integer address arithmetic for every thread of a CTA."""

    def __init__(self, threads: int, table_param: str) -> None:
        self.t = threads
        self.table_param = table_param
        self.regs: dict[str, object] = {}
        self.fresh = 0

    def const(self, v: int) -> _Aff:
        return _Aff((), np.full(self.t, v, dtype=np.int64))

    def uniform(self, table: bool) -> _Aff:
        self.fresh += 1
        return _Aff(((_Sym(f"u{self.fresh}", table), 1),), np.zeros(self.t, dtype=np.int64))

    def operand(self, tok: str):
        tok = tok.strip()
        if tok in ("%tid.x",):
            return _Aff((), np.arange(self.t, dtype=np.int64))
        if tok in ("%tid.y", "%tid.z"):
            return self.const(0)
        if tok.startswith("%"):
            if tok in self.regs:
                return self.regs[tok]
            return self.uniform(False)  # %ctaid, %nctaid, a register defined later (a loop phi)
        if re.fullmatch(r"-?\d+", tok):
            return self.const(int(tok))
        if re.fullmatch(r"0x[0-9a-fA-F]+", tok):
            return self.const(int(tok, 16))
        return self.uniform(False)  # float immediates and the like

    def generic(self, vals: list):
        if any(v is NU for v in vals):
            return NU
        if all(v.uniform for v in vals):
            return self.uniform(any(v.table for v in vals))
        return NU

    def mul(self, a, b):
        if a is NU or b is NU:
            return NU
        for x, y in ((a, b), (b, a)):
            if x.concrete and x.uniform:
                c = int(x.off[0])
                return _Aff(tuple((s, k * c) for s, k in y.terms), y.off * c)
        if a.concrete and b.concrete:
            return _Aff((), a.off * b.off)
        return self.generic([a, b])

    def add(self, a, b, sign: int = 1):
        if a is NU or b is NU:
            return NU
        return _Aff(_merge(a.terms, b.terms, sign), a.off + sign * b.off)

    def concrete_op(self, op: str, vals: list, signed: bool):
        a = vals[0].off
        b = vals[1].off if len(vals) > 1 else None
        if op == "and":
            return a & b
        if op == "xor":
            return a ^ b
        if op == "shr":
            if signed:
                return a >> b
            return (a.view(np.uint64) >> np.clip(b, 0, 63).astype(np.uint64)).view(np.int64)
        if op == "min":
            return np.minimum(a, b)
        if op == "max":
            return np.maximum(a, b)
        if op == "div":
            return np.where(b != 0, a // np.where(b == 0, 1, b), 0)
        if op == "rem":
            return np.where(b != 0, a % np.where(b == 0, 1, b), 0)
        if op == "not":
            return ~a
        if op == "bfe":
            c = vals[2].off
            return (a >> b) & ((1 << c) - 1)
        return None

    def step(self, stmt: str) -> Access | None:
        pred = ""
        if stmt.startswith("@"):
            pred, _, stmt = stmt.partition(" ")
            stmt = stmt.strip()
        opcode, _, rest = stmt.partition(" ")
        parts = opcode.split(".")
        op = parts[0]
        rest = rest.strip()
        if op in ("ld", "st", "atom", "red") and "global" in parts:
            return self.memory(op, parts, rest, pred)
        if op in ("bra", "ret", "bar", "exit", "fence", "membar"):
            return None
        args = [x.strip() for x in re.split(r",(?![^{]*})", rest) if x.strip()]
        if not args:
            return None
        dst = args[0]
        srcs = args[1:]
        dsts = [d.strip() for d in dst.strip("{} ").split(",")] if dst.startswith("{") else [dst]
        if op in ("ld", "ldmatrix", "shfl", "redux", "atom", "red", "cvta") or "shared" in parts:
            # shared-memory loads and shuffles: reductions (uniform results) and layout conversions of data
            if op == "ld" and "param" in parts:
                name = re.search(r"\[(\w+)\]", rest).group(1)
                val = _Aff(((_Sym(name, name == self.table_param), 1),), np.zeros(self.t, dtype=np.int64))
                for d in dsts:
                    self.regs[d] = val
                return None
            for d in dsts:
                self.regs[d] = self.uniform(False)
            return None
        if op == "setp" or any(d.startswith("%p") for d in dsts):
            return None
        vals = [self.operand(s) for s in srcs if not s.startswith("%p") and not s.startswith("!%p")]
        signed = any(p.startswith("s") and p[1:].isdigit() for p in parts[1:])
        flt = any(p.startswith("f") and p[1:].isdigit() for p in parts[1:])  # float arithmetic: not an address
        if (op == "mov" and len(vals) == 1) or (op == "cvt" and not flt and len(vals) == 1):
            val = vals[0]
        elif op == "add" and len(vals) == 2 and not flt:
            val = self.add(vals[0], vals[1])
        elif op == "sub" and len(vals) == 2 and not flt:
            val = self.add(vals[0], vals[1], -1)
        elif op == "or" and len(vals) == 2:
            if vals[0] is not NU and vals[1] is not NU and vals[0].concrete and vals[1].concrete:
                val = _Aff((), vals[0].off | vals[1].off)
            else:  # LLVM emits ``or`` for an add of disjoint bits (an aligned start plus a lane offset)
                val = self.add(vals[0], vals[1])
        elif op == "mul" and len(vals) == 2 and not flt:
            val = self.mul(vals[0], vals[1])
        elif op == "shl" and len(vals) == 2:
            b = vals[1]
            if b is not NU and b.concrete and b.uniform:
                val = self.mul(vals[0], self.const(1 << int(b.off[0])))
            else:
                val = self.generic(vals)
        elif op == "mad" and len(vals) == 3 and not flt:
            val = self.add(self.mul(vals[0], vals[1]), vals[2])
        elif op == "neg" and len(vals) == 1 and vals[0] is not NU and not flt:
            val = _Aff(tuple((s, -c) for s, c in vals[0].terms), -vals[0].off)
        elif all(v is not NU and v.concrete for v in vals) and vals and not flt:
            out = self.concrete_op(op, vals, signed)
            val = _Aff((), out) if out is not None else self.generic(vals)
        else:
            val = self.generic(vals)
        for d in dsts:
            self.regs[d] = val
        return None

    def memory(self, op: str, parts: list[str], rest: str, pred: str) -> Access:
        m = _MEM.search(rest)
        addr = self.operand(m.group(1))
        if addr is not NU and m.group(2):
            addr = self.add(addr, self.const(int(m.group(2))))
        vector = 1
        for p in parts:
            if p in ("v2", "v4", "v8"):
                vector = int(p[1:])
        bits = 32
        wm = _WIDTH.search(opcode_of(parts))
        if wm:
            bits = int(wm.group(1))
        width = vector * bits // 8
        store = op in ("st", "red") or (op == "atom")
        if op in ("ld", "atom"):
            regs = _REG.findall(rest.split("[")[0])
            val = self.uniform(addr.table) if addr is not NU and addr.uniform else NU
            for r in regs:
                self.regs[r] = val
        if op in ("atom", "red"):
            kind = "uniform" if addr is not NU and addr.uniform else "other"
        elif addr is NU:
            kind = "other"
        elif addr.uniform:
            kind = "uniform"
        elif addr.table:
            kind = "data"
        else:
            kind = "other"
        distinct = width * (len(np.unique(addr.off)) if addr is not NU else 1)
        return Access(-1, store, width, vector, kind, distinct, f"{pred} {op}.{'.'.join(parts[1:])}".strip())


def opcode_of(parts: list[str]) -> str:
    return "." + parts[-1]


@dataclass
class Traffic:
    """Bytes per element of the chunk loop's paths, and what was counted."""

    min_load: float
    min_store: float
    max_load: float
    max_store: float
    v4_loads: int
    v4_stores: int
    data_accesses: int
    uniform_accesses: int
    other_accesses: int
    vector_widths: tuple[int, ...]

    @property
    def min_total(self) -> float:
        return self.min_load + self.min_store

    @property
    def max_total(self) -> float:
        return self.max_load + self.max_store


def analyze(ptx: str, *, block: int, num_warps: int, table_param_index: int = 0) -> Traffic:
    """Bytes per element loaded and stored by the chunk loop of the kernel in ``ptx`` (one ``.entry``), whose
    address-table parameter is number ``table_param_index`` and whose chunks hold ``block`` elements."""
    name = re.search(r"\.entry\s+(\w+)\(", ptx).group(1)
    blocks = _split_blocks(ptx)
    _edges(blocks)
    ev = _Eval(32 * num_warps, f"{name}_param_{table_param_index}")
    accesses: dict[int, list[Access]] = {}
    for _ in range(3):  # later definitions (loop phis) reach earlier uses on the next pass
        accesses = {}
        for b in blocks:
            out = accesses.setdefault(b.num, [])
            for stmt in b.instrs:
                acc = ev.step(stmt)
                if acc is not None:
                    acc.block = b.num
                    out.append(acc)
    by_num = {b.num: b for b in blocks}
    headers = [b.num for b in blocks if b.header_depth == 1]
    data_in = {h: sum(a.kind == "data" for b in blocks if h in b.loops for a in accesses[b.num]) for h in headers}
    if headers and max(data_in.values()) > 0:
        head = max(headers, key=lambda h: data_in[h])
        members = {b.num for b in blocks if head in b.loops}
    else:  # no loop: the whole kernel from its entry
        head = blocks[0].num
        members = {b.num for b in blocks}

    def weight(num: int) -> tuple[float, float]:
        acc = [a for a in accesses[num] if a.kind == "data"]
        return (sum(a.distinct_bytes for a in acc if not a.store) / block,
                sum(a.distinct_bytes for a in acc if a.store) / block)

    # DFS from the header inside the loop: back edges (to a block on the stack) end a path
    order: list[int] = []
    state: dict[int, int] = {}
    back: set[tuple[int, int]] = set()

    def dfs(n: int) -> None:
        state[n] = 1
        for s in by_num[n].succ:
            if s not in members:
                continue
            if state.get(s) == 1:
                back.add((n, s))
            elif s not in state:
                dfs(s)
        state[n] = 2
        order.append(n)

    import sys

    sys.setrecursionlimit(max(10000, sys.getrecursionlimit()))
    dfs(head)
    best: dict[int, tuple] = {}
    for n in order:  # reverse topological order of the DAG
        ld, st = weight(n)
        nexts = [best[s] for s in by_num[n].succ if s in members and (n, s) not in back and s in best]
        ends = not nexts or any(s == head for s in by_num[n].succ) or any(
            (n, s) in back for s in by_num[n].succ) or any(s not in members for s in by_num[n].succ)
        cands_min = [x[0] for x in nexts] + ([(0.0, 0.0)] if ends else [])
        cands_max = [x[1] for x in nexts] + ([(0.0, 0.0)] if ends else [])
        lo = min(cands_min, key=lambda x: x[0] + x[1])
        hi = max(cands_max, key=lambda x: x[0] + x[1])
        best[n] = ((ld + lo[0], st + lo[1]), (ld + hi[0], st + hi[1]))
    (mn, mx) = best[head]
    data = [a for n in members for a in accesses[n] if a.kind == "data"]
    everything = [a for n in members for a in accesses[n]]
    return Traffic(
        min_load=mn[0], min_store=mn[1], max_load=mx[0], max_store=mx[1],
        v4_loads=sum(1 for a in data if not a.store and a.width == 16),
        v4_stores=sum(1 for a in data if a.store and a.width == 16),
        data_accesses=len(data),
        uniform_accesses=sum(a.kind == "uniform" for a in everything),
        other_accesses=sum(a.kind == "other" for a in everything),
        vector_widths=tuple(sorted({a.width for a in data})),
    )
