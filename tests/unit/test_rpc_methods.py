"""The RPC names the observers count and log under are the contract's, and any other name is one value."""

from __future__ import annotations

from loraswap.server.observability.calls import RPC_METHODS, UNKNOWN_METHOD, method_name
from loraswap.v1 import diffusion_service_pb2 as pb

CONTRACT_RPCS = [method.name for method in pb.DESCRIPTOR.services_by_name["DiffusionService"].methods]


def test_the_known_methods_are_the_contracts_rpcs() -> None:
    assert sorted(RPC_METHODS) == sorted(CONTRACT_RPCS)
    assert UNKNOWN_METHOD not in CONTRACT_RPCS


def test_any_other_name_is_the_one_unknown_method() -> None:
    assert [method_name(rpc) for rpc in CONTRACT_RPCS] == CONTRACT_RPCS
    for made_up in ("MadeUp1", "generate", "Generate\n", "", "x" * 10_000):
        assert method_name(made_up) == UNKNOWN_METHOD
