"""Each sequence's block table and prefix hashes, kept over the block pool (which blocks are
free or shared) and the paged KV (their tensors)."""
from __future__ import annotations

from .block_pool import BlockPool, block_hash
from ..kv import PagedKV


class KVManager:
    def __init__(self, pool: BlockPool, kv: PagedKV, prefix_sharing: bool = True):
        self.pool, self.kv, self.prefix_sharing = pool, kv, prefix_sharing
        self.shared_tokens = 0  # prompt tokens found in cached blocks instead of computed

    def admit(self, seq, reserve: int) -> bool | None:
        """Blocks for all of seq's tokens, its longest cached prefix shared, keeping `reserve` blocks
        free (headroom for the running sequences). Sets seq.blocks and seq.computed (the shared
        tokens). False: no room; None: another sequence is computing this prefix right now (wait a
        step for it rather than compute it twice)."""
        pool, bs, n = self.pool, self.pool.block_size, len(seq.tokens)
        if not seq.names:  # the full blocks before the last token, which is always computed
            parent = None
            for i in range((n - 1) // bs):
                parent = block_hash(parent, seq.tokens[i * bs:(i + 1) * bs])
                seq.names.append(parent)
        shared: list[int] = []
        if self.prefix_sharing and seq.result.prompt_logprobs is None:  # echo needs every prompt token's logits
            shared, pending = pool.lookup(seq.names)
            if pending:
                return None
        need = pool.blocks_for(n) - len(shared)
        revived = sum(1 for b in shared if pool.refs[b] == 0)  # cached blocks count as free
        if need + revived + reserve > pool.n_free:
            return False
        pool.share(shared)
        seq.blocks = shared + self._allocate(need)
        seq.n_ready, seq.computed = len(shared), len(shared) * bs
        self.shared_tokens += seq.computed
        if self.prefix_sharing:  # announce the prompt blocks about to be computed
            for i in range(len(shared), len(seq.names)):
                pool.name(seq.blocks[i], seq.names[i], ready=False)
        return True

    def grow(self, seq, n: int) -> bool:
        """Blocks for seq's next n tokens; False when the pool cannot cover them."""
        need = self.pool.blocks_for(seq.computed + n) - len(seq.blocks)
        if need > self.pool.n_free:
            return False
        seq.blocks += self._allocate(max(need, 0))
        return True

    def _allocate(self, n: int) -> list[int]:
        blocks = self.pool.allocate(n)
        self.kv.first_use(blocks)
        return blocks

    def publish(self, seq) -> None:
        """Blocks this step filled become shareable: named (prompt blocks were named at
        admission, waiting to be computed) and marked ready."""
        if not self.prefix_sharing:
            return
        bs = self.pool.block_size
        while (seq.n_ready + 1) * bs <= seq.computed:
            i = seq.n_ready
            if i < len(seq.names):
                self.pool.mark_ready(seq.blocks[i])
            else:
                seq.names.append(block_hash(seq.names[-1] if seq.names else None, seq.tokens[i * bs:(i + 1) * bs]))
                self.pool.name(seq.blocks[i], seq.names[i], ready=True)
            seq.n_ready += 1

    def free(self, seq, forget_names: bool = False) -> None:
        """Return seq's blocks; forget_names: its tokens will change meaning (recomputed after a
        preemption), so its hash chain is rebuilt on readmission."""
        self.pool.release(seq.blocks)
        seq.blocks, seq.computed, seq.n_ready = [], 0, 0
        if forget_names:
            seq.names = []

    def held(self, running) -> int:
        """Tokens held in the pool (shared blocks counted once): blocks in use minus this is what
        paging wastes, the unfilled end of each sequence's last block."""
        bs, fill = self.pool.block_size, {}
        for seq in running:
            for i, b in enumerate(seq.blocks):
                fill[b] = max(fill.get(b, 0), min(bs, max(seq.computed - i * bs, 0)))
        return sum(fill.values())
