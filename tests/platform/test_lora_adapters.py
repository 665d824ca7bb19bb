"""Adapter folders in, checked adapters out (platform/lora/adapter.py, registry.py), and the
prefix cache kept apart per adapter identity, on the real SmolLM2 engine.

Adapter folders here are written by hand in PEFT's format (adapter_config.json +
adapter_model.safetensors) so that each bad input can be made exactly.
"""

from __future__ import annotations

import json

import pytest
import torch
from lora_folders import write_adapter
from safetensors.torch import save_file

from splitserve.platform.config import LoraConfig
from splitserve.platform.errors import ConfigError
from splitserve.platform.lora.adapter import AdapterError
from splitserve.platform.lora.registry import AdapterNotFoundError, LoraRegistry
from splitserve.platform.sampling.params import SamplingParams

pytestmark = pytest.mark.slow

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


@pytest.fixture(scope="module")
def registry_factory(smollm2_model):
    from splitserve.platform.lora.batch import attach

    _, layout = attach(smollm2_model)
    return lambda **kw: LoraRegistry(LoraConfig(**kw), layout, torch.float32)


def test_scale_rank_targets_and_digest(tmp_path, registry_factory):
    reg = registry_factory(max_lora_rank=16)
    plain = reg.add("plain", write_adapter(tmp_path / "a", r=16, alpha=32))
    rs = reg.add("rs", write_adapter(tmp_path / "b", r=16, alpha=32, use_rslora=True))
    assert (plain.scale, rs.scale) == (2.0, 8.0)
    assert plain.target_modules == ("q_proj", "v_proj") and plain.rank == 16
    qkv = plain.weights["layers.0.self_attn.qkv_proj"]
    assert qkv.a_t.shape == (576, 32) and [(start, b.shape) for start, b in qkv.blocks] == [
        (0, (16, 576)),
        (768, (16, 192)),
    ]
    b_t = qkv.b_t()  # the torch form: q and v blocks in their slices, k's columns untouched
    assert b_t.shape == (32, 960) and b_t[:16, 576:768].abs().sum() == 0 and b_t[16:, 768:].abs().sum() > 0
    assert "layers.0.mlp.down_proj" not in plain.weights
    again = reg.add("plain", write_adapter(tmp_path / "a", r=16, alpha=32))
    assert again.digest == plain.digest and rs.digest != plain.digest


@pytest.mark.parametrize(
    "make, reason",
    [
        (lambda d: str(d / "missing"), "is not a folder"),
        (lambda d: (d.mkdir(), str(d))[1], "cannot read adapter_config.json"),
        (lambda d: write_adapter(d, r=32), "rank 32 is over this server's max_lora_rank 16"),
        (lambda d: write_adapter(d, modules=("q_proj", "lm_head")), r"target_modules \['lm_head'\] are not supported"),
        (lambda d: write_adapter(d, use_dora=True), "unsupported settings"),
        (lambda d: write_adapter(d, modules_to_save=["lm_head"]), "unsupported settings"),
        (lambda d: write_adapter(d, r=0), "r must be an integer >= 1"),
        (lambda d: write_adapter(d, layers=[30]), "layer 30, which this model lacks"),
    ],
)
def test_bad_adapters_are_refused_with_the_reason(tmp_path, registry_factory, make, reason):
    reg = registry_factory(max_lora_rank=16)
    with pytest.raises(AdapterError, match=reason):
        reg.add("bad", make(tmp_path / "ad"))
    assert reg.names() == []


def test_bad_files_are_refused_with_the_reason(tmp_path, registry_factory):
    reg = registry_factory()
    path = write_adapter(tmp_path / "a")
    (tmp_path / "a" / "adapter_config.json").write_text("{not json")
    with pytest.raises(AdapterError, match="not valid JSON"):
        reg.add("x", path)
    path = write_adapter(tmp_path / "b")
    (tmp_path / "b" / "adapter_model.safetensors").write_bytes(b"garbage")
    with pytest.raises(AdapterError, match="not a readable safetensors"):
        reg.add("x", path)
    path = write_adapter(tmp_path / "c")
    save_file(
        {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 576)},
        str(tmp_path / "c" / "adapter_model.safetensors"),
    )
    with pytest.raises(AdapterError, match="adapts a module we do not have"):
        reg.add("x", path)
    path = write_adapter(tmp_path / "d", r=8)
    (tmp_path / "d" / "adapter_config.json").write_text(
        json.dumps({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]})
    )
    with pytest.raises(AdapterError, match=r"needs \(4, 576\) for r=4"):
        reg.add("x", path)
    with pytest.raises(AdapterError, match="adapter name"):
        reg.add("has space", write_adapter(tmp_path / "e"))


def test_cpu_lru_evicts_least_recently_used_and_reloads_on_demand(tmp_path, registry_factory):
    reg = registry_factory(max_loras=1, max_cpu_loras=2)
    for name in "abc":
        reg.add(name, write_adapter(tmp_path / name, seed=ord(name)))
    assert [a.name for a in reg.loaded()] == ["b", "c"] and reg.names() == ["a", "b", "c"]
    loads = reg.num_loads
    reg.get("b")  # a hit: no read, b becomes most recent
    assert reg.num_loads == loads and [a.name for a in reg.loaded()] == ["c", "b"]
    reg.get("a")  # evicted earlier: read again, c is now the LRU victim
    assert reg.num_loads == loads + 1 and [a.name for a in reg.loaded()] == ["b", "a"]
    reg.remove("a")
    with pytest.raises(AdapterNotFoundError, match="adapters: b, c"):
        reg.get("a")
    with pytest.raises(AdapterNotFoundError):
        reg.remove("a")


def test_a_full_memory_evicts_what_other_workers_also_hold_first(tmp_path, registry_factory):
    """The router's hint (GenerateRequest.lora_evict_first): adapters other workers also hold go
    before the least recently used one that only this worker holds; without a hint, or with a
    hint naming nothing this worker holds, eviction is plain LRU."""
    reg = registry_factory(max_loras=1, max_cpu_loras=3)
    paths = {name: write_adapter(tmp_path / name, seed=ord(name)) for name in "abcdef"}
    for name in "abcdef":
        reg.add(name, paths[name])  # d, e, f stay in memory
    reg.get("d")  # LRU order now e, f, d
    assert reg.install(reg.read("a", paths["a"]), evict_first=["d", "f"]).name == "a"
    assert [x.name for x in reg.loaded()] == ["e", "d", "a"]  # f: the LRU of the hinted, not e
    assert reg.num_hinted_evictions == 1
    reg.install(reg.read("b", paths["b"]), evict_first=["zzz", "b"])  # nothing held is hinted
    assert [x.name for x in reg.loaded()] == ["d", "a", "b"] and reg.num_hinted_evictions == 1
    reg.install(reg.read("c", paths["c"]))
    assert [x.name for x in reg.loaded()] == ["a", "b", "c"]


def test_an_adapter_read_off_the_engine_thread_is_installed_unless_something_changed(tmp_path, registry_factory):
    """A worker reads an evicted adapter in another thread (lookup -> read -> install); meanwhile
    another request may have read it, the name may have moved to another folder or gone."""
    reg = registry_factory(max_loras=1, max_cpu_loras=1)
    reg.add("a", write_adapter(tmp_path / "a", seed=1))
    reg.add("b", write_adapter(tmp_path / "b", seed=2))  # evicts a
    adapter, path = reg.lookup("a")
    assert adapter is None and path == str(tmp_path / "a")
    loads = reg.num_loads
    read = reg.read("a", path)  # no state touched
    assert reg.num_loads == loads and [x.name for x in reg.loaded()] == ["b"]
    assert reg.install(read) is read and [x.name for x in reg.loaded()] == ["a"] and reg.num_loads == loads + 1
    assert reg.install(reg.read("a", path)) is read  # a second read lost the race
    stale = reg.read("b", str(tmp_path / "b"))
    reg.add("b", write_adapter(tmp_path / "b2", seed=3))  # b now names another folder...
    reg.add("a", path)  # ...and is evicted again
    fresh = reg.install(stale)  # the new folder is read instead
    assert fresh.path == str(tmp_path / "b2") and fresh.digest == reg.digest("b") != stale.digest
    reg.remove("a")
    with pytest.raises(AdapterNotFoundError):
        reg.install(read)


def test_lora_config_is_validated():
    with pytest.raises(ConfigError, match="max_cpu_loras .1. must be >= max_loras .2."):
        LoraConfig(max_loras=2, max_cpu_loras=1)
    with pytest.raises(ConfigError, match="max_loras must be >= 1"):
        LoraConfig(max_loras=0)
    with pytest.raises(ConfigError, match="twice"):
        LoraConfig(modules=(("a", "/x"), ("a", "/y")))


def test_prefix_cache_never_shares_blocks_across_adapters(tmp_path, make_engine):
    engine = make_engine()
    engine.load_lora_adapter("a", write_adapter(tmp_path / "a", seed=1))
    engine.load_lora_adapter("b", write_adapter(tmp_path / "b", seed=2))
    prompt = [(i * 7919) % 40000 + 100 for i in range(100)]  # 6 full blocks reusable

    def run(lora):
        rid = engine.add_request(params=GREEDY, prompt_token_ids=prompt, lora_name=lora)
        final = {}
        while engine.has_unfinished_requests():
            final.update({o.req_id: o for o in engine.step() if o.finished})
        return final[rid]

    first_a = run("a")
    assert first_a.num_cached_tokens == 0
    assert run("b").num_cached_tokens == 0  # another adapter: nothing of a's KV
    assert run(None).num_cached_tokens == 0  # the base model: nothing either
    again_a = run("a")
    assert again_a.num_cached_tokens == 96 and again_a.output_token_ids == first_a.output_token_ids
    engine.load_lora_adapter("a", write_adapter(tmp_path / "a2", seed=3))  # other weights, same name
    replaced = run("a")
    assert replaced.num_cached_tokens == 0 and replaced.output_token_ids != first_a.output_token_ids
    assert engine.num_cached_prefix_tokens(prompt, "a") == 96 and engine.num_cached_prefix_tokens(prompt, "b") == 96
    engine.pool.check_invariants()
