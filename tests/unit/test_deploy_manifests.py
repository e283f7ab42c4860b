"""The deployment files validate offline against each system's own schema or types.

Kubernetes objects against the Kubernetes OpenAPI schemas (kubernetes-validate,
strict: unknown fields fail); the Envoy bootstrap against Envoy's protobuf types
(envoy-data-plane: unknown fields fail at every level, typed_config included); the
Istio DestinationRule against Istio's published CRD models (cloudcoil-models-istio,
round-tripped so a misspelt field fails); the HAProxy config with `haproxy -c`.
"""

from __future__ import annotations

import copy
import importlib
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
KUBERNETES = DEPLOY / "kubernetes"
KUBERNETES_VERSION = "1.30.0"
ENVOY_TYPED_CONFIGS = (
    "envoy.extensions.filters.network.http_connection_manager.v3",
    "envoy.extensions.filters.http.router.v3",
    "envoy.extensions.upstreams.http.v3",
)


def _documents(name: str) -> list[dict]:
    return [doc for doc in yaml.safe_load_all((KUBERNETES / name).read_text()) if doc]


def _validate_kubernetes(document: dict) -> None:
    import kubernetes_validate

    kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)


def _validate_envoy(bootstrap: dict):
    for module in ENVOY_TYPED_CONFIGS:  # registers the typed_config types the bootstrap packs
        importlib.import_module(f"envoy_data_plane.{module}")
    from envoy_data_plane.envoy.config.bootstrap.v3 import Bootstrap

    return Bootstrap.from_dict(bootstrap)


def _validate_istio(rule: dict) -> None:
    from cloudcoil.models.istio.networking import v1 as istio

    parsed = istio.DestinationRule.model_validate(rule).model_dump(by_alias=True, exclude_none=True, mode="json")
    assert parsed == rule, f"fields Istio's DestinationRule does not know: {rule} != {parsed}"


@pytest.mark.parametrize("name", ["replicas.yaml", "envoy-front.yaml"])
def test_kubernetes_objects_validate(name: str) -> None:
    documents = _documents(name)
    assert documents
    for document in documents:
        _validate_kubernetes(document)


def test_kubernetes_validation_catches_a_misspelt_field() -> None:
    import kubernetes_validate

    deployment = copy.deepcopy(_documents("replicas.yaml")[0])
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {"grpc": {"port": 50051}}
    with pytest.raises(kubernetes_validate.ValidationError):
        _validate_kubernetes(deployment)


def test_replicas_probe_the_grpc_health_service_and_drain_within_their_grace() -> None:
    deployment, service = _documents("replicas.yaml")
    pod = deployment["spec"]["template"]["spec"]
    container = pod["containers"][0]
    for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
        assert container[probe]["grpc"]["port"] == 50051
    grace = float(next(e["value"] for e in container["env"] if e["name"] == "LORASWAP_GRACE_SECONDS"))
    pause = float(container["lifecycle"]["preStop"]["exec"]["command"][-1])
    assert pod["terminationGracePeriodSeconds"] >= pause + grace
    startup = container["startupProbe"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 600, "a compile and warm-up need minutes"
    assert service["spec"]["clusterIP"] == "None", "the fronts hash over every replica's address"


def test_envoy_bootstrap_validates_and_hashes_on_lora_under_a_balance_factor() -> None:
    bootstrap = _validate_envoy(yaml.safe_load((KUBERNETES / "envoy.yaml").read_text()))
    cluster = bootstrap.static_resources.clusters[0]
    assert cluster.lb_policy.name == "RING_HASH"
    assert cluster.common_lb_config.consistent_hashing_lb_config.hash_balance_factor == 250
    assert cluster.health_checks[0].grpc_health_check is not None
    connection_manager = yaml.safe_load((KUBERNETES / "envoy.yaml").read_text())["static_resources"]["listeners"][0]
    route = connection_manager["filter_chains"][0]["filters"][0]["typed_config"]["route_config"]
    assert route["virtual_hosts"][0]["routes"][0]["route"]["hash_policy"] == [{"header": {"header_name": "lora"}}]


def test_envoy_validation_catches_a_misspelt_field_inside_a_typed_config() -> None:
    bootstrap = yaml.safe_load((KUBERNETES / "envoy.yaml").read_text())
    bootstrap["static_resources"]["listeners"][0]["filter_chains"][0]["filters"][0]["typed_config"]["stat_prefx"] = "x"
    with pytest.raises(KeyError):
        _validate_envoy(bootstrap)


def test_istio_destination_rule_validates_and_hashes_on_lora() -> None:
    (rule,) = _documents("istio-destinationrule.yaml")
    _validate_istio(rule)
    assert rule["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderName"] == "lora"
    misspelt = copy.deepcopy(rule)
    misspelt["spec"]["trafficPolicy"]["loadBalancer"]["consistentHash"]["httpHeaderNme"] = "lora"
    with pytest.raises(AssertionError):
        _validate_istio(misspelt)


def test_kustomization_names_every_file_it_needs() -> None:
    kustomization = yaml.safe_load((KUBERNETES / "kustomization.yaml").read_text())
    for name in [*kustomization["resources"], *kustomization["configMapGenerator"][0]["files"]]:
        assert (KUBERNETES / name).is_file(), name
    volumes = _documents("envoy-front.yaml")[0]["spec"]["template"]["spec"]["volumes"]
    assert volumes[0]["configMap"]["name"] == kustomization["configMapGenerator"][0]["name"]


@pytest.mark.skipif(shutil.which("haproxy") is None, reason="haproxy is not installed here (.ci/run installs it)")
def test_haproxy_config_is_valid() -> None:
    result = subprocess.run(
        ["haproxy", "-c", "-f", str(DEPLOY / "haproxy" / "haproxy.cfg")], capture_output=True, text=True, check=False
    )
    assert result.returncode == 0, result.stdout + result.stderr
