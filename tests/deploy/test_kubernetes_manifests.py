"""deploy/kubernetes/ checked offline, with no cluster: every built-in kind against the Kubernetes API schemas that
kubernetes-validate ships (strict: an unknown field is an error, as kubectl's server-side validation makes it), the
InferencePool and HTTPRoute against their CRDs' schemas (tests/data/kubernetes/, with jsonschema), the kustomizations
against their folders (and `kubectl kustomize` when kubectl is installed); and the manifests against the server: the
settings the container starts with, the probes' paths and ports, the ports the Service and the pool send to, the
selectors, a grace period that outlasts the drain, and the metric names they mention."""

from __future__ import annotations

import copy
import importlib.util
import re
import shlex
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
import yaml
from prometheus_client.parser import text_string_to_metric_families
from pydantic_settings import CliApp

from transformers_openai.api.routes import build_ops_router
from transformers_openai.metrics import LOAD_GAUGES, Metrics
from transformers_openai.settings import Settings

ROOT = Path(__file__).resolve().parents[2]
MANIFESTS = ROOT / "deploy" / "kubernetes"
SCHEMAS = ROOT / "tests" / "data" / "kubernetes"
DOCKERFILE = ROOT / "Dockerfile"
ENTRYPOINT_SCRIPT = ROOT / "deploy" / "entrypoint.py"

# The Kubernetes version whose API schemas the built-in kinds are checked against (kubernetes-validate 1.37.0 ships
# 1.25 to 1.37); the manifests use nothing newer.
KUBERNETES_VERSION = "1.33"
# The custom resources, by (apiVersion, kind): the schema file of their CRD's served version.
CRD_SCHEMAS = {
    ("inference.networking.k8s.io/v1", "InferencePool"): "inferencepool-v1.yaml",
    ("gateway.networking.k8s.io/v1", "HTTPRoute"): "httproute-v1.yaml",
}
# A pod name as the downward API would give it (metadata.name).
POD_NAME = "transformers-openai-api-7d9f8b6c5d-x2x4q"
# After the drain, uvicorn gives open connections this long to close (main.run, timeout_graceful_shutdown).
UVICORN_CLOSE_S = 5
_METRIC_NAME = re.compile(r"\b(?:vllm|transformers_openai):[a-z_]+")


# ---------------------------------------------------------------------------------------------------- helpers


def manifest_files() -> list[Path]:
    return sorted(path for path in MANIFESTS.rglob("*.yaml") if path.name != "kustomization.yaml")


def documents() -> list[tuple[Path, dict[str, Any]]]:
    found = []
    for path in manifest_files():
        for document in yaml.safe_load_all(path.read_text()):
            if document is not None:
                found.append((path, document))
    return found


def the(kind: str) -> dict[str, Any]:
    matches = [document for _, document in documents() if document["kind"] == kind]
    assert len(matches) == 1, f"deploy/kubernetes/ has {len(matches)} {kind}s, not one"
    return matches[0]


def document_id(item: tuple[Path, dict[str, Any]]) -> str:
    path, document = item
    return f"{path.relative_to(MANIFESTS)}:{document['kind']}"


def server_container() -> dict[str, Any]:
    (container,) = the("Deployment")["spec"]["template"]["spec"]["containers"]
    return dict(container)


def container_port() -> int:
    (port,) = server_container()["ports"]
    return int(port["containerPort"])


def port_number(port: int | str) -> int:
    """A probe's or a Service's port: a number, or the name of one of the container's ports."""
    if isinstance(port, int):
        return port
    named = {entry["name"]: int(entry["containerPort"]) for entry in server_container()["ports"]}
    assert port in named, f"no container port is named {port!r}"
    return named[port]


def dockerfile_env() -> dict[str, str]:
    """The image's ENV (KEY=VALUE pairs; continuation lines joined)."""
    env: dict[str, str] = {}
    for instruction in DOCKERFILE.read_text().replace("\\\n", " ").splitlines():
        keyword, _, arguments = instruction.strip().partition(" ")
        if keyword == "ENV":
            for pair in shlex.split(arguments):
                name, _, value = pair.partition("=")
                env[name] = value
    return env


def entrypoint() -> Any:
    spec = importlib.util.spec_from_file_location("entrypoint", ENTRYPOINT_SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def container_env_and_args() -> tuple[dict[str, str], list[str]]:
    """What the server process gets: the image's ENV, the container's env (downward API filled in) and its args,
    with Kubernetes' $(VAR) expansion, through the image's entry point."""
    container = server_container()
    env = dockerfile_env()
    for variable in container.get("env", []):
        if "value" in variable:
            env[variable["name"]] = str(variable["value"])
        else:
            field = variable["valueFrom"]["fieldRef"]["fieldPath"]
            assert field == "metadata.name", f"the test knows no value for {field}"
            env[variable["name"]] = POD_NAME
    args = [re.sub(r"\$\((\w+)\)", lambda match: env.get(match[1], match[0]), arg) for arg in container["args"]]
    assert "command" not in container, "the image's entry point starts the server"
    return entrypoint().server_environment(env, args), args


@pytest.fixture
def settings(monkeypatch: pytest.MonkeyPatch) -> Settings:
    """The server's settings in the container, as main() builds them (CLI over environment over defaults)."""
    env, args = container_env_and_args()
    names = {name.upper() for name in Settings.model_fields} | {"HF_MODEL", "TORCH_DTYPE", "API_KEYS"}
    for name in names:
        monkeypatch.delenv(name, raising=False)
        monkeypatch.delenv(name.lower(), raising=False)
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    return CliApp.run(Settings, cli_args=args)


def ops_paths() -> set[str]:
    return {route.path for route in build_ops_router().routes}  # type: ignore[attr-defined]


def strict(schema: Any) -> Any:
    """The CRD schema as the API server applies it with kubectl's default --validate=strict: an unknown field is an
    error (a structural schema would otherwise prune it, and jsonschema would let it pass)."""
    if isinstance(schema, list):
        return [strict(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    result = {key: (strict(value) if key != "properties" else value) for key, value in schema.items()}
    if "properties" in schema:
        result["properties"] = {name: strict(sub) for name, sub in schema["properties"].items()}
        if "additionalProperties" not in schema and not schema.get("x-kubernetes-preserve-unknown-fields"):
            result["additionalProperties"] = False
    return result


def crd_validator(api_version: str, kind: str) -> jsonschema.protocols.Validator:
    loaded = yaml.safe_load((SCHEMAS / CRD_SCHEMAS[(api_version, kind)]).read_text())
    assert f"{loaded['group']}/{loaded['version']}" == api_version and loaded["kind"] == kind
    schema = strict(loaded["openAPIV3Schema"])
    jsonschema.Draft202012Validator.check_schema(schema)
    return jsonschema.Draft202012Validator(schema)


def validation_errors(document: dict[str, Any]) -> list[str]:
    key = (document["apiVersion"], document["kind"])
    if key in CRD_SCHEMAS:
        errors = crd_validator(*key).iter_errors(document)
        return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}" for error in errors]
    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(map(str, error.absolute_path))}: {error.message}"]
    return []


# ------------------------------------------------------------------------------------------- schemas and files


def test_the_manifests_are_there() -> None:
    kinds = sorted(document["kind"] for _, document in documents())
    assert kinds == ["Deployment", "HTTPRoute", "InferencePool", "Service"]


@pytest.mark.parametrize("item", documents(), ids=document_id)
def test_manifest_validates_against_its_schema(item: tuple[Path, dict[str, Any]]) -> None:
    _, document = item
    assert validation_errors(document) == []


def test_validators_catch_mistakes() -> None:
    """An unknown field, a wrong type and a field of an older API version each fail: the checks above can fail."""
    deployment = copy.deepcopy(the("Deployment"))
    deployment["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    assert any("'readinesProbe' was unexpected" in error for error in validation_errors(deployment))
    service = copy.deepcopy(the("Service"))
    service["spec"]["ports"][0]["port"] = "seven thousand"
    assert any("is not of type 'integer'" in error for error in validation_errors(service))
    pool = copy.deepcopy(the("InferencePool"))
    pool["spec"]["targetPortNumber"] = pool["spec"].pop("targetPorts")[0]["number"]  # v1alpha2's field
    assert any("'targetPortNumber' was unexpected" in error for error in validation_errors(pool))
    route = copy.deepcopy(the("HTTPRoute"))
    route["spec"]["rules"][0]["timeouts"]["request"] = "an hour"
    assert any("does not match" in error for error in validation_errors(route))


def test_kubernetes_validate_works_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """The schemas come with the package: the version asked for is the one used, with every connection refused."""

    def no_network(*args: Any, **kwargs: Any) -> None:
        raise OSError("no network in this test")

    monkeypatch.setattr(socket.socket, "connect", no_network)
    assert kubernetes_validate.validate(the("Deployment"), KUBERNETES_VERSION, strict=True) == KUBERNETES_VERSION


def kustomizations() -> list[Path]:
    return sorted(MANIFESTS.rglob("kustomization.yaml"))


@pytest.mark.parametrize("kustomization", kustomizations(), ids=lambda path: str(path.relative_to(MANIFESTS)))
def test_kustomization_lists_every_manifest_of_its_folder(kustomization: Path) -> None:
    resources = yaml.safe_load(kustomization.read_text())["resources"]
    files = sorted(path.name for path in kustomization.parent.glob("*.yaml") if path != kustomization)
    assert sorted(resources) == files


def test_every_manifest_folder_has_a_kustomization() -> None:
    assert {path.parent for path in manifest_files()} == {path.parent for path in kustomizations()}


@pytest.fixture(scope="module")
def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed: the kustomizations are not built")
    return found


@pytest.mark.parametrize("kustomization", kustomizations(), ids=lambda path: str(path.relative_to(MANIFESTS)))
def test_kubectl_kustomize_builds_the_folder(kubectl: str, kustomization: Path) -> None:
    folder = kustomization.parent
    built = subprocess.run([kubectl, "kustomize", str(folder)], capture_output=True, text=True, check=True).stdout
    objects = [document for document in yaml.safe_load_all(built) if document]
    expected = [document for path, document in documents() if path.parent == folder]
    assert sorted((o["kind"], o["metadata"]["name"]) for o in objects) == sorted(
        (o["kind"], o["metadata"]["name"]) for o in expected
    )
    for document in objects:
        assert validation_errors(document) == [], document["kind"]


# ------------------------------------------------------------------------------------------ the server they run


def test_container_runs_the_server_as_configured(settings: Settings) -> None:
    container = server_container()
    assert container["image"].split(":")[0] == "transformers-openai-api", "the image our Dockerfile builds"
    assert settings.host == "0.0.0.0"
    assert settings.port == container_port()
    assert settings.metrics_compat == "vllm"
    assert settings.replica_id == POD_NAME, "--replica-id from the pod name (downward API)"
    assert settings.model == "Qwen/Qwen2.5-1.5B-Instruct" and settings.model_name == "Qwen2.5-1.5B-Instruct"
    assert not settings.auth_health_and_metrics, "the probes send no API key"


@pytest.mark.parametrize(
    ("probe", "path"), [("startupProbe", "/health"), ("readinessProbe", "/ready"), ("livenessProbe", "/health")]
)
def test_probes_ask_the_server_where_it_answers(probe: str, path: str, settings: Settings) -> None:
    get = server_container()[probe]["httpGet"]
    assert get["path"] == path and path in ops_paths()
    assert port_number(get["port"]) == settings.port


def test_startup_probe_waits_for_a_model_download() -> None:
    probe = server_container()["startupProbe"]
    assert probe["periodSeconds"] * probe["failureThreshold"] >= 15 * 60, "at least the image's 15 min start period"


def test_grace_period_outlasts_the_drain(settings: Settings) -> None:
    pod = the("Deployment")["spec"]["template"]["spec"]
    command = server_container()["lifecycle"]["preStop"]["exec"]["command"]
    assert command[0] == "sleep"
    pre_stop_s = float(command[1])
    assert pod["terminationGracePeriodSeconds"] > pre_stop_s + settings.shutdown_timeout + UVICORN_CLOSE_S


def test_service_sends_to_the_container_port() -> None:
    (port,) = the("Service")["spec"]["ports"]
    assert port_number(port["targetPort"]) == container_port()


def test_pool_sends_to_the_container_port() -> None:
    assert [entry["number"] for entry in the("InferencePool")["spec"]["targetPorts"]] == [container_port()]


def test_selectors_pick_the_servers_pods() -> None:
    deployment = the("Deployment")
    labels = deployment["spec"]["template"]["metadata"]["labels"]
    selectors = {
        "Deployment": deployment["spec"]["selector"]["matchLabels"],
        "Service": the("Service")["spec"]["selector"],
        "InferencePool": the("InferencePool")["spec"]["selector"]["matchLabels"],
    }
    for kind, selector in selectors.items():
        assert selector and selector.items() <= labels.items(), f"the {kind}'s selector misses the pods"


def test_route_sends_to_the_pool() -> None:
    pool = the("InferencePool")
    (rule,) = the("HTTPRoute")["spec"]["rules"]
    (backend,) = rule["backendRefs"]
    assert (backend["group"], backend["kind"], backend["name"]) == (
        "inference.networking.k8s.io",
        "InferencePool",
        pool["metadata"]["name"],
    )
    # The CRD's CEL rule, which jsonschema does not evaluate: a Service (the default kind) needs a port.
    picker = pool["spec"]["endpointPickerRef"]
    assert picker.get("kind", "Service") != "Service" or "port" in picker


def test_one_gpu_and_the_model_cache_volume() -> None:
    container = server_container()
    assert container["resources"]["limits"]["nvidia.com/gpu"] == 1
    (mount,) = container["volumeMounts"]
    assert mount["mountPath"] == dockerfile_env()["HF_HOME"]
    volumes = {volume["name"] for volume in the("Deployment")["spec"]["template"]["spec"]["volumes"]}
    assert mount["name"] in volumes


def test_prometheus_annotations_name_the_metrics_endpoint(settings: Settings) -> None:
    annotations = the("Deployment")["spec"]["template"]["metadata"]["annotations"]
    assert int(annotations["prometheus.io/port"]) == settings.port
    assert annotations["prometheus.io/path"] in ops_paths()


def exported_metric_names(compat: str) -> set[str]:
    text = Metrics("model", compat=compat).render().decode()
    names = set()
    for family in text_string_to_metric_families(text):
        names.add(family.name)
        names.update(sample.name for sample in family.samples)
    return names


def mentioned_metric_names() -> Iterator[tuple[Path, str]]:
    for path in [*manifest_files(), *kustomizations()]:
        for name in _METRIC_NAME.findall(path.read_text()):
            yield path, name


def test_metrics_the_manifests_name_are_exported(settings: Settings) -> None:
    exported = exported_metric_names(settings.metrics_compat)
    mentioned = list(mentioned_metric_names())
    assert mentioned
    for path, name in mentioned:
        assert name in exported, f"{path.relative_to(ROOT)} names {name}, which /metrics does not export"
    # The gauges the endpoint picker reads are all named where the pool is.
    pool_text = (MANIFESTS / "inference-gateway" / "inferencepool.yaml").read_text()
    assert {f"vllm:{gauge}" for gauge in LOAD_GAUGES} <= set(_METRIC_NAME.findall(pool_text))
