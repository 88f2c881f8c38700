"""deploy/: the Kubernetes manifests, the compose file and the Dockerfile, checked without a cluster.

- every k8s object validates (strict: unknown fields are errors) against the Kubernetes schema
  that `kubernetes-validate` ships (offline), for the oldest version it ships with gRPC probes GA
  and its newest;
- every container command is a real `beamsplit` subcommand with real flags, parsed by the CLI's
  own parser with the ConfigMap's TOML file in place of the mounted one;
- every port a container, a probe or a Service names is one the server listens on (--port,
  --metrics-port, --transfer-port as parsed), and the coordinator lists every worker pod by a
  name its headless Service gives it;
- the compose file names the same roles, with consistent ports; the image's entry point is
  `beamsplit` and its default command parses.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import kubernetes_validate
import pytest
import yaml

from beamsplit.cli import build_parser
from beamsplit.cli.config_file import parse_args_with_config

DEPLOY = Path(__file__).resolve().parents[2] / "deploy"
K8S_FILES = sorted((DEPLOY / "k8s").glob("*.yaml"))
K8S_VERSIONS = ["1.27.0", kubernetes_validate.latest_version()]
ROLES = {"context", "generation", "coordinator"}
POD_IP = "10.1.2.3"


def k8s_objects() -> list[dict[str, Any]]:
    objects = []
    for path in K8S_FILES:
        objects.extend(document for document in yaml.safe_load_all(path.read_text()) if document)
    return objects


def workloads() -> list[dict[str, Any]]:
    return [item for item in k8s_objects() if item["kind"] in ("Deployment", "StatefulSet")]


def by_kind_and_name(kind: str, name: str) -> dict[str, Any]:
    matches = [item for item in k8s_objects() if item["kind"] == kind and item["metadata"]["name"] == name]
    assert len(matches) == 1, f"{kind}/{name}: {len(matches)} objects"
    return matches[0]


def container_args(workload: dict[str, Any], tmp_path: Path) -> argparse.Namespace:
    """The container's args parsed by the CLI, with mounted ConfigMap files written under tmp_path."""
    pod = workload["spec"]["template"]["spec"]
    (container,) = pod["containers"]
    assert "command" not in container, "the image's entry point (beamsplit) runs the args"
    env_values = {"POD_IP": POD_IP}
    for variable in container.get("env", []):
        assert variable["name"] in env_values, f"unexpected env {variable['name']}"
    args = [
        re.sub(r"\$\((\w+)\)", lambda match: env_values[match.group(1)], arg) for arg in container["args"]
    ]
    volumes = {volume["name"]: volume for volume in pod["volumes"]}
    for mount in container.get("volumeMounts", []):
        config_map = volumes[mount["name"]].get("configMap")
        if config_map is None:
            continue
        data = by_kind_and_name("ConfigMap", config_map["name"])["data"]
        local_dir = tmp_path / mount["name"]
        local_dir.mkdir(exist_ok=True)
        for key, text in data.items():
            (local_dir / key).write_text(text)
        args = [arg.replace(mount["mountPath"], str(local_dir)) for arg in args]
    return parse_args_with_config(build_parser(), args)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("path", K8S_FILES, ids=lambda path: path.name)
def test_every_manifest_validates_against_the_kubernetes_schema(path: Path, version: str) -> None:
    documents = [document for document in yaml.safe_load_all(path.read_text()) if document]
    assert documents
    for document in documents:
        kubernetes_validate.validate(document, version, strict=True)


def test_the_validator_rejects_a_broken_manifest() -> None:
    broken = by_kind_and_name("StatefulSet", "beamsplit-context")
    broken = yaml.safe_load(yaml.safe_dump(broken))
    broken["spec"]["template"]["spec"]["containers"][0]["readinessProbe"]["grpc"]["prot"] = 1
    with pytest.raises(kubernetes_validate.ValidationError):
        kubernetes_validate.validate(broken, K8S_VERSIONS[0], strict=True)


def test_one_workload_and_one_service_per_role() -> None:
    roles = {}
    for workload in workloads():
        role = workload["spec"]["template"]["metadata"]["labels"]["role"]
        roles[role] = workload["kind"]
        assert workload["spec"]["selector"]["matchLabels"]["role"] == role
        services = [
            item
            for item in k8s_objects()
            if item["kind"] == "Service"
            and item["spec"]["selector"] == workload["spec"]["selector"]["matchLabels"]
        ]
        assert len(services) == 1, f"{role}: {len(services)} Services"
    # Workers are StatefulSets: the coordinator needs one stable address per pod (see deploy/README.md).
    assert roles == {"context": "StatefulSet", "generation": "StatefulSet", "coordinator": "Deployment"}


def test_container_args_are_real_subcommands_and_ports_are_the_ones_served(tmp_path: Path) -> None:
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        (container,) = pod["containers"]
        args = container_args(workload, tmp_path)
        role = workload["spec"]["template"]["metadata"]["labels"]["role"]
        assert (args.command, args.role) == ("serve", role)

        listened = {"grpc": args.port, "metrics": args.metrics_port}
        if role != "coordinator":
            listened["transfer"] = args.transfer_port
            assert args.advertise_host == POD_IP
        assert all(port > 0 for port in listened.values()), f"{role}: a port left to chance {listened}"
        assert args.host == "0.0.0.0"
        declared = {port["name"]: port["containerPort"] for port in container["ports"]}
        assert declared == listened, role

        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            assert container[probe]["grpc"] == {"port": args.port}, f"{role} {probe}"
        assert pod["terminationGracePeriodSeconds"] > args.shutdown_grace_s

        resources = container["resources"]
        if role == "coordinator":
            assert "nvidia.com/gpu" not in resources.get("requests", {})
        else:
            assert resources["requests"]["nvidia.com/gpu"] == resources["limits"]["nvidia.com/gpu"] == 1
            assert args.device == "cuda:0"  # the pod's one GPU

        service = by_kind_and_name("Service", f"beamsplit-{role}")
        for port in service["spec"]["ports"]:
            assert port["targetPort"] in declared, f"{role} Service targets {port['targetPort']}"
            assert port["port"] == declared[port["targetPort"]]


def test_the_coordinator_lists_every_worker_pod_by_its_stable_name(tmp_path: Path) -> None:
    coordinator = container_args(by_kind_and_name("Deployment", "beamsplit-coordinator"), tmp_path)
    for role, addresses in (("context", coordinator.context), ("generation", coordinator.generation)):
        workload = by_kind_and_name("StatefulSet", f"beamsplit-{role}")
        service = by_kind_and_name("Service", workload["spec"]["serviceName"])
        assert service["spec"]["clusterIP"] == "None"  # headless: per-pod DNS names
        worker_port = container_args(workload, tmp_path).port
        expected = [
            f"{workload['metadata']['name']}-{ordinal}.{service['metadata']['name']}:{worker_port}"
            for ordinal in range(workload["spec"]["replicas"])
        ]
        assert addresses.split(",") == expected
        assert workload["spec"]["replicas"] >= 2  # several replicas behind the coordinator


def compose_services() -> dict[str, Any]:
    return dict(yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"])


def with_compose_defaults(arg: str) -> str:
    """`${VAR:-default}` as compose substitutes it when VAR is unset."""
    return re.sub(r"\$\{\w+:-([^}]*)\}", lambda match: match.group(1), arg)


def compose_args() -> Iterator[tuple[str, argparse.Namespace, dict[str, Any]]]:
    for name, service in compose_services().items():
        args = build_parser().parse_args([with_compose_defaults(arg) for arg in service["command"]])
        yield name, args, service


def test_compose_runs_the_same_roles_with_consistent_ports() -> None:
    parsed = {name: (args, service) for name, args, service in compose_args()}
    assert {args.role for args, _ in parsed.values()} == ROLES == set(parsed)
    assert {args.command for args, _ in parsed.values()} == {"serve"}
    ports = {name: args.port for name, (args, _) in parsed.items()}
    assert len(set(ports.values())) == 3
    for name, (args, service) in parsed.items():
        health_target = re.search(r"insecure_channel\('([^']+)'\)", service["healthcheck"]["test"][-1])
        assert health_target is not None and health_target.group(1) == f"{args.host}:{args.port}", name
        assert args.metrics_port > 0
    coordinator = parsed["coordinator"][0]
    assert coordinator.context == f"127.0.0.1:{ports['context']}"
    assert coordinator.generation == f"127.0.0.1:{ports['generation']}"
    assert (parsed["context"][0].device, parsed["generation"][0].device) == ("cuda:0", "cuda:1")
    assert set(parsed["coordinator"][1]["depends_on"]) == {"context", "generation"}


def dockerfile_instruction(name: str) -> list[str]:
    lines = [line for line in (DEPLOY / "Dockerfile").read_text().splitlines() if line.startswith(name + " ")]
    assert len(lines) == 1, f"{name}: {lines}"
    return lines[0][len(name) + 1 :].split()


def test_image_entry_point_is_beamsplit_and_its_default_command_parses() -> None:
    import json

    entrypoint = json.loads(" ".join(dockerfile_instruction("ENTRYPOINT")))
    assert entrypoint == ["beamsplit"]
    pyproject = (DEPLOY.parent / "pyproject.toml").read_text()
    assert 'beamsplit = "beamsplit.cli:main"' in pyproject
    command = json.loads(" ".join(dockerfile_instruction("CMD")))
    assert build_parser().parse_args(command).command == command[0]

    exposed = {int(port) for port in dockerfile_instruction("EXPOSE")}
    for workload in workloads():
        for port in workload["spec"]["template"]["spec"]["containers"][0]["ports"]:
            assert port["containerPort"] in exposed

    copied = {
        line.split()[1]
        for line in (DEPLOY / "Dockerfile").read_text().splitlines()
        if line.startswith("COPY ")
    }
    include = re.search(r"include = \[([^\]]*)\]", pyproject)
    assert include is not None
    for package in re.findall(r'"(\w+)\*"', include.group(1)):
        assert package in copied, f"the image misses package {package}"


def test_two_gpu_script_starts_the_same_roles() -> None:
    script = (DEPLOY / "two_gpu.sh").read_text()
    started = set(re.findall(r"^\s*(?:CUDA_VISIBLE_DEVICES= )?start (\w+) (\w+)", script, re.MULTILINE))
    assert {role for _, role in started} >= ROLES
    assert all(name == role for name, role in started)
