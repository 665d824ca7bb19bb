"""The second KV tier (platform/kv/tier.py) on a real SmolLM2 engine with a small cache.

Prompts are long enough (7 full blocks) and the cache small enough (16 blocks) that serving
two other prompts evicts the first one's blocks from the pool; the tier keeps them, and the
first prompt served again restores them instead of computing them. Greedy output must be
identical to an engine that computed everything, the pool's invariants must hold after every
request, and a tampered tier file must be rejected and its blocks recomputed.
"""

import os

import pytest

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, KVTierConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError
from splitserve.platform.kv.block_pool import TIER_SECOND, BlockRemoved, BlockStored
from splitserve.platform.sampling.params import SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
NUM_BLOCKS = 16
BLOCK_BYTES = 2 * 30 * 16 * 3 * 64 * 4  # K and V, 30 layers, 16 tokens, 3 KV heads x 64, fp32


def prompt(seed: int, num_tokens: int = 7 * 16 + 5) -> list[int]:
    return [(i * 7919 + seed * 104729) % 40000 + 100 for i in range(num_tokens)]


def engine(model, tier: KVTierConfig | None) -> LLMEngine:
    return LLMEngine(
        EngineConfig(
            model="smollm2-135m",
            cache=CacheConfig(num_blocks=NUM_BLOCKS),
            scheduler=SchedulerConfig(max_model_len=NUM_BLOCKS * 16),
            device=DeviceConfig(quantization="none"),
            kv_tier=tier,
        ),
        model=model,
    )


def serve(eng: LLMEngine, token_ids: list[int]) -> list[int]:
    [out] = eng.generate([token_ids], GREEDY)
    eng.kv.check_invariants()
    assert eng.pool.num_free_blocks == NUM_BLOCKS  # nothing leaked
    return out.output_token_ids


def num_block_files(eng: LLMEngine) -> int:
    """Block files in the tier's folder (its owner lock, `.owner`, is not a block)."""
    return sum(not name.startswith(".") for name in os.listdir(eng.kv_tier.store.directory))


def push_out(eng: LLMEngine, token_ids: list[int]) -> None:
    """Serve other prompts until none of `token_ids`' blocks is left in the pool (two or three:
    the pool takes blocks without a hash before cached ones)."""
    hashes = eng.hasher.hash_blocks(token_ids)
    for seed in (101, 102, 103):
        serve(eng, prompt(seed))
        if not any(eng.pool.peek(h) for h in hashes):
            return
    raise AssertionError("three other prompts left some of the prompt's blocks in the pool")


@pytest.fixture(scope="module")
def computed(smollm2_model):
    """Greedy outputs of an engine without a tier (everything computed)."""
    eng = engine(smollm2_model, None)
    return {seed: serve(eng, prompt(seed)) for seed in (1, 2)}


def test_restored_prefix_gives_identical_output(smollm2_model, computed, tmp_path):
    eng = engine(smollm2_model, KVTierConfig(max_bytes=64 * BLOCK_BYTES, directory=str(tmp_path)))
    a = prompt(1)
    assert serve(eng, a) == computed[1]
    push_out(eng, a)
    hashes = eng.hasher.hash_blocks(a)
    assert all(eng.kv_tier.holds(h) for h in hashes)
    assert eng.num_cached_prefix_tokens(a) == 7 * 16  # the estimate counts the tier
    events = eng.take_kv_events()
    assert any(isinstance(e, BlockStored) and e.tier == TIER_SECOND and hashes[0] in e.block_hashes for e in events)

    assert serve(eng, a) == computed[1]
    assert eng.kv_tier.stats.num_hits == 7
    assert eng.scheduler.requests == {} and all(eng.pool.peek(h) for h in hashes)
    assert eng.kv_tier.stats.num_bytes == eng.kv_tier.stats.num_blocks * BLOCK_BYTES
    assert num_block_files(eng) == eng.kv_tier.stats.num_blocks


def test_tier_evicts_its_own_lru(smollm2_model, computed, tmp_path):
    eng = engine(smollm2_model, KVTierConfig(max_bytes=4 * BLOCK_BYTES + 100, directory=str(tmp_path)))
    a = prompt(1)
    serve(eng, a)
    push_out(eng, a)
    stats = eng.kv_tier.stats
    assert stats.num_blocks == 4 and stats.num_evictions == stats.num_stored - 4 > 0
    assert num_block_files(eng) == 4
    dropped = {
        h for e in eng.take_kv_events() if isinstance(e, BlockRemoved) and e.tier == TIER_SECOND for h in e.block_hashes
    }
    assert len(dropped) == stats.num_evictions
    assert serve(eng, a) == computed[1]  # a's blocks fell out of both tiers: recomputed, same answer


def test_corrupt_tier_file_is_rejected_and_recomputed(smollm2_model, computed, tmp_path):
    eng = engine(smollm2_model, KVTierConfig(max_bytes=64 * BLOCK_BYTES, directory=str(tmp_path)))
    b = prompt(2)
    serve(eng, b)
    push_out(eng, b)
    hashes = eng.hasher.hash_blocks(b)
    path = eng.kv_tier.store.path(hashes[3])
    with open(path, "r+b") as f:  # flip one byte of the payload's end
        f.seek(-1, os.SEEK_END)
        last = f.read(1)
        f.seek(-1, os.SEEK_END)
        f.write(bytes([last[0] ^ 0xFF]))
    eng.take_kv_events()
    assert serve(eng, b) == computed[2]
    stats = eng.kv_tier.stats
    assert stats.num_rejected == 1 and stats.num_hits == 3  # blocks 0..2 restored, 3.. recomputed
    assert not os.path.exists(path)
    events = eng.take_kv_events()
    assert any(isinstance(e, BlockRemoved) and e.tier == TIER_SECOND and e.block_hashes == (hashes[3],) for e in events)


def test_host_memory_tier_restores_too(smollm2_model, computed):
    eng = engine(smollm2_model, KVTierConfig(max_bytes=64 * BLOCK_BYTES))
    a = prompt(1)
    serve(eng, a)
    push_out(eng, a)
    assert serve(eng, a) == computed[1]
    assert eng.kv_tier.stats.num_hits == 7


def test_file_tier_folder_is_removed_on_close(smollm2_model, tmp_path):
    eng = engine(smollm2_model, KVTierConfig(max_bytes=64 * BLOCK_BYTES, directory=str(tmp_path / "tier")))
    folder = eng.kv_tier.store.directory
    assert os.path.isdir(folder) and os.path.dirname(folder) == str(tmp_path / "tier")
    eng.kv_tier.close()
    assert not os.path.exists(folder)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(max_bytes=0), "positive number of bytes"),
        (dict(max_bytes=1024, directory=""), "must name a folder"),
    ],
)
def test_tier_config_is_validated(kwargs, message):
    with pytest.raises(ConfigError, match=message):
        KVTierConfig(**kwargs)


def test_tier_smaller_than_a_block_is_refused(smollm2_model, tmp_path):
    with pytest.raises(ConfigError, match=f"raise --kv-tier-bytes to at least {BLOCK_BYTES}"):
        engine(smollm2_model, KVTierConfig(max_bytes=BLOCK_BYTES - 1, directory=str(tmp_path)))


@pytest.mark.parametrize(
    "args, message",
    [
        (["--kv-tier-bytes", "0"], "'0' is not a size; allowed: a positive number of bytes"),
        (["--kv-tier-bytes", "4 parsecs"], "allowed: a positive number of bytes, or a number with one of the units"),
        (["--kv-tier-dir", "/tmp/kv"], "--kv-tier-dir needs --kv-tier-bytes"),
    ],
)
def test_worker_flags_are_validated(args, message):
    import pathlib
    import subprocess
    import sys

    cli = str(pathlib.Path(sys.executable).parent / "splitserve")
    proc = subprocess.run([cli, "worker", *args], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and message in proc.stderr, proc.stderr


def test_restore_whose_own_evictions_overflow_the_tier(smollm2_model, computed, tmp_path):
    """The restore's allocation evicts other blocks into a nearly full tier, whose LRU then drops
    the very entries being restored: they were read first, so the answer is still the computed
    one, and the pool and tier stay consistent."""
    eng = engine(smollm2_model, KVTierConfig(max_bytes=9 * BLOCK_BYTES, directory=str(tmp_path)))
    a = prompt(1)
    serve(eng, a)
    # a's 7 blocks become the tier's only entries; the pool holds 101's and 102's. 102 is one
    # block longer: the pool hands out the blocks without a hash first (a's last and 101's last
    # block), so 102 needs 9 blocks to reach all of a's
    serve(eng, prompt(101))
    serve(eng, prompt(102, 8 * 16 + 5))
    hashes = eng.hasher.hash_blocks(a)
    assert not any(eng.pool.peek(h) for h in hashes)
    assert all(eng.kv_tier.holds(h) for h in hashes) and eng.kv_tier.stats.num_blocks == 7
    assert serve(eng, a) == computed[1]  # its 7 allocations evict 101's blocks into the tier: a's drop out
    stats = eng.kv_tier.stats
    assert stats.num_hits == 7 and stats.num_blocks == 9 and stats.num_evictions >= 5
    assert all(eng.pool.peek(h) for h in hashes) and not all(eng.kv_tier.holds(h) for h in hashes)
    assert num_block_files(eng) == stats.num_blocks
