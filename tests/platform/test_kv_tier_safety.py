"""The second KV tier and the block pool under failure and attack (issue 42's tier findings).

* A tier whose writes fail (disk full) loses its copies, never the pool's blocks: checked at
  pool level with a real KVTier whose file writes raise ENOSPC, and on a real SmolLM2 engine,
  where every request is still answered with the computed tokens.
* A tier folder left by a worker killed with SIGKILL (a real child process) is reclaimed by the
  next store started under the same parent; a live store's folder is left alone.
* A forged tier file whose header was recomputed without the service's key is rejected.
* The pool's undrained KV-event list stays bounded in an engine nobody subscribes to, and what
  is left still replays to exactly the hashes the pool holds.
"""

from __future__ import annotations

import errno
import hashlib
import os
import struct
import subprocess
import sys
import textwrap

import pytest
import torch

from splitserve.platform.config import CacheConfig, DeviceConfig, EngineConfig, KVTierConfig, SchedulerConfig
from splitserve.platform.engine.llm_engine import LLMEngine
from splitserve.platform.errors import ConfigError
from splitserve.platform.kv import tier as tier_module
from splitserve.platform.kv.block_pool import TIER_CACHE, AllCleared, BlockPool, BlockRemoved, BlockStored
from splitserve.platform.kv.tier import FileStore, KVTier
from splitserve.platform.sampling.params import SamplingParams

SECRET = b"service-kv-secret-0123456789abcdef"
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


def disk_full(*_args, **_kwargs):
    raise OSError(errno.ENOSPC, "No space left on device")


def small_caches(num_blocks: int, num_layers: int = 2) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.randn(num_blocks, 4, 2, 8), torch.randn(num_blocks, 4, 2, 8)) for _ in range(num_layers)]


def fill_and_free(pool: BlockPool, num_blocks: int, seed: int) -> None:
    """Allocate, register under fresh hashes, and free `num_blocks` blocks."""
    blocks = pool.allocate(num_blocks)
    hashes = [hashlib.sha256(f"{seed}/{i}".encode()).digest() for i in range(num_blocks)]
    pool.cache_blocks(blocks, hashes, None)
    pool.free(reversed(blocks))


# -- a failing tier returns the blocks ---------------------------------------------------------


def test_a_tier_write_failure_at_pool_level_loses_no_block(tmp_path, monkeypatch):
    num_blocks = 4
    pool = BlockPool(num_blocks)
    tier = KVTier(KVTierConfig(max_bytes=1 << 20, directory=str(tmp_path)), small_caches(num_blocks), "test|fp32")
    pool.eviction_sink = tier
    fill_and_free(pool, num_blocks, seed=1)  # 4 cached, free blocks
    monkeypatch.setattr(tier.store, "put", disk_full)  # the disk fills up
    got = pool.allocate(num_blocks)  # evicts all 4 into the failing tier
    assert sorted(b.block_id for b in got) == list(range(num_blocks))
    assert tier.stats.num_write_failures == num_blocks and tier.stats.num_blocks == 0
    pool.free(reversed(got))
    pool.check_invariants()
    assert pool.num_free_blocks == num_blocks
    assert not [f for f in os.listdir(tier.store.directory) if not f.startswith(".")]  # no partial files
    tier.close()


def test_a_tier_that_raises_anything_still_hands_out_the_blocks():
    class BrokenSink:
        def offload(self, evicted):
            raise RuntimeError("tier exploded")

        def clear(self):
            return []

        def held_hashes(self):
            return []

    pool = BlockPool(4, eviction_sink=BrokenSink())
    fill_and_free(pool, 4, seed=2)
    got = pool.allocate(3)
    assert len(got) == 3 and pool.num_free_blocks == 1 and pool.stats.num_sink_failures == 1
    pool.free(reversed(got))
    pool.check_invariants()
    assert pool.num_free_blocks == 4


def test_an_engine_with_a_full_disk_answers_every_request(smollm2_model, tmp_path, monkeypatch):
    """16 blocks and prompts of 7 full blocks: serving four prompts in turn evicts into the tier,
    whose every write fails. All requests finish with the tokens an engine without a tier gives."""

    def engine(tier):
        return LLMEngine(
            EngineConfig(
                model="smollm2-135m",
                cache=CacheConfig(num_blocks=16),
                scheduler=SchedulerConfig(max_model_len=256),
                device=DeviceConfig(quantization="none"),
                kv_tier=tier,
            ),
            model=smollm2_model,
        )

    prompts = [[(i * 7919 + s * 104729) % 40000 + 100 for i in range(117)] for s in (1, 2, 3, 1)]
    plain = engine(None)
    reference = [plain.generate([token_ids], GREEDY)[0].output_token_ids for token_ids in prompts[:3]]
    monkeypatch.setattr(FileStore, "put", disk_full)
    eng = engine(KVTierConfig(max_bytes=64 << 20, directory=str(tmp_path)))
    answered = []
    for token_ids in prompts:
        [out] = eng.generate([token_ids], GREEDY)
        answered.append(out.output_token_ids)
        eng.kv.check_invariants()
        assert eng.pool.num_free_blocks == 16
    assert answered == reference + [reference[0]]
    assert eng.kv_tier.stats.num_write_failures > 0 and eng.kv_tier.stats.num_blocks == 0


# -- folders of dead workers ---------------------------------------------------------------------


def test_a_folder_left_by_a_sigkilled_worker_is_reclaimed_at_start(tmp_path):
    parent = tmp_path / "kv-tier"
    child = textwrap.dedent(f"""
        import os, signal, torch
        from splitserve.platform.kv.tier import FileStore
        store = FileStore({str(parent)!r}, "test|fp32", (2, 4), torch.float32, b"k" * 32)
        store.put(b"h" * 32, torch.ones(2, 4))
        print(store.directory, flush=True)
        os.kill(os.getpid(), signal.SIGKILL)
    """)
    proc = subprocess.run([sys.executable, "-c", child], capture_output=True, text=True, timeout=120)
    assert proc.returncode == -9, proc.stderr
    dead = proc.stdout.strip()
    assert os.path.isdir(dead) and len(os.listdir(dead)) == 2  # the lock file and one block: left behind

    live = FileStore(str(parent), "test|fp32", (2, 4), torch.float32, b"k" * 32)  # a live worker beside it
    restarted = FileStore(str(parent), "test|fp32", (2, 4), torch.float32, b"k" * 32)
    assert not os.path.exists(dead) and live.reclaimed == [dead] and restarted.reclaimed == []
    assert sorted(os.listdir(parent)) == sorted(
        [os.path.basename(live.directory), os.path.basename(restarted.directory)]
    )
    live.close()
    restarted.close()
    assert os.listdir(parent) == []


# -- a keyed tier ---------------------------------------------------------------------------------


def test_a_forged_file_with_a_recomputed_header_is_rejected(tmp_path):
    key = tier_module.tier_key(SECRET)
    store = FileStore(str(tmp_path), "test|fp32", (2, 4), torch.float32, key)
    block_hash = b"b" * 32
    store.put(block_hash, torch.ones(2, 4))
    assert torch.equal(store.get(block_hash), torch.ones(2, 4))

    forged = torch.full((2, 4), 7.0).view(torch.uint8).numpy().tobytes()
    layout = b"test|fp32"
    prefix = tier_module._MAGIC + struct.pack("<I", len(layout)) + layout + block_hash
    for mac in (
        hashlib.sha256(forged).digest(),  # an unkeyed digest
        hashlib.sha256(prefix + forged).digest(),  # unkeyed, header included
        FileStore(
            str(tmp_path / "other"),
            "test|fp32",
            (2, 4),
            torch.float32,
            tier_module.tier_key(b"another-services-secret!!"),
        )._mac(prefix, forged),
    ):  # wrong key
        with open(store.path(block_hash), "wb") as f:
            f.write(prefix + mac + forged)
        assert store.get(block_hash) is None

    with open(store.path(block_hash), "wb") as f:  # the same bytes under the service's key pass
        f.write(prefix + store._mac(prefix, forged) + forged)
    assert torch.equal(store.get(block_hash), torch.full((2, 4), 7.0))
    store.close()


def test_the_service_secret_keys_the_tier_and_is_validated(tmp_path):
    assert tier_module.tier_key(SECRET) == tier_module.tier_key(SECRET)
    assert tier_module.tier_key(None) != tier_module.tier_key(None)  # no secret: a random key per process
    with pytest.raises(ConfigError, match="at least 16 bytes"):
        KVTierConfig(max_bytes=1 << 20, directory=str(tmp_path), secret=b"short")


def test_the_worker_passes_its_kv_secret_to_the_tier(tmp_path):
    from splitserve.platform.settings.worker_args import WorkerArgs

    secret_file = tmp_path / "kv-secret"
    secret_file.write_bytes(SECRET + b"\n")
    args = WorkerArgs(kv_tier_bytes=1 << 20, kv_tier_dir=str(tmp_path), kv_secret_file=str(secret_file))
    assert args.kv_tier_config().secret == SECRET


# -- bounded events --------------------------------------------------------------------------------


def replay(events) -> set[bytes]:
    held: set[bytes] = set()
    for event in events:
        if isinstance(event, AllCleared):
            held.clear()
        elif isinstance(event, BlockStored) and event.tier == TIER_CACHE:
            held.update(event.block_hashes)
        elif isinstance(event, BlockRemoved) and event.tier == TIER_CACHE:
            held.difference_update(event.block_hashes)
    return held


def test_undrained_kv_events_stay_bounded_and_replay_to_the_pool():
    pool = BlockPool(8, max_pending_events=64)
    for seed in range(2000):  # an offline engine: nothing ever calls take_events()
        fill_and_free(pool, 3, seed)
        assert pool.num_pending_events <= 64 + 2
    assert pool.stats.num_event_compactions > 0
    assert replay(pool.take_events()) == set(pool.cached_hashes())
    pool.check_invariants()


def test_the_default_event_bound_holds_for_a_long_offline_run():
    pool = BlockPool(16)
    for seed in range(3000):
        fill_and_free(pool, 4, seed)
    assert pool.num_pending_events <= pool.max_pending_events + 2
    with pytest.raises(ValueError, match="max_pending_events must be an integer >= 8"):
        BlockPool(4, max_pending_events=0)
