"""The baked k8s/ manifests against the releases they target, without a cluster.

- Each manifest is validated against its CRD's openAPIV3Schema (tests/schemas/, vendored from
  Kubeflow Trainer v2.3.0 and JobSet v0.12.0) the way the API server's strict field validation
  reads it: a field the schema does not name is an error, and so are wrong types, missing
  required fields, values outside an enum and list-map keys given twice. (The CRDs' CEL rules,
  x-kubernetes-validations, are not evaluated.)
- The TrainJob survives a round trip through a real client of Trainer v2.3.0's API
  (kubeflow-trainer-api 2.3.0) with nothing dropped.
- The JobSet's failure policies, evaluated as Kubernetes and JobSet evaluate them: a pod that
  exits 143 (stopped on SIGTERM after its checkpoint) or is evicted restarts the set without
  counting toward maxRestarts; any other failure counts.
"""

import re
from pathlib import Path

import pytest
import yaml
from conftest import bake_ok
from kubeflow_trainer_api.models import TrainerV1alpha1TrainJob

SCHEMAS = Path(__file__).resolve().parent / "schemas"
COUNTS = (("1", "1"), ("2", "8"), ("4", "2"))  # (num_nodes, gpus_per_node)
DNS_LABEL = r"[a-z]([-a-z0-9]{0,61}[a-z0-9])?"  # RFC 1035, as TrainJob names must be
DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"  # RFC 1123
TYPES = {"object": dict, "array": list, "string": str, "integer": int, "number": (int, float), "boolean": bool}


@pytest.fixture(scope="module", params=COUNTS, ids=lambda counts: "x".join(counts))
def baked(request, cookies_session):
    nodes, gpus = request.param
    project = bake_ok(cookies_session, project_name=f"k8s manifests {nodes} {gpus}", task="tabular",
                      kubernetes="yes", num_nodes=nodes, gpus_per_node=gpus)  # fmt: skip
    manifests = {
        name: yaml.safe_load((project / "k8s" / f"{name}.yaml").read_text()) for name in ("trainjob", "jobset")
    }
    return {**manifests, "Dockerfile": (project / "Dockerfile").read_text()}


def schema(name):
    return yaml.safe_load((SCHEMAS / name).read_text())


def errors(value, schema, path="$"):
    """What strict field validation refuses in `value`, one line per error."""
    expected = schema.get("type")
    if schema.get("x-kubernetes-int-or-string"):  # its anyOf is just these two types
        if not isinstance(value, (int, str)) or isinstance(value, bool):
            return [f"{path}: {value!r} is neither an integer nor a string"]
    elif expected and (not isinstance(value, TYPES[expected]) or (isinstance(value, bool) and expected != "boolean")):
        return [f"{path}: {value!r} is not of type {expected}"]
    found = [f"{path}: {value!r} not in {schema['enum']}"] if "enum" in schema and value not in schema["enum"] else []
    if isinstance(value, str):
        if len(value) > schema.get("maxLength", len(value)) or len(value) < schema.get("minLength", 0):
            found.append(f"{path}: length {len(value)} out of bounds")
        if "pattern" in schema and not re.search(schema["pattern"], value):
            found.append(f"{path}: {value!r} does not match {schema['pattern']}")
    if isinstance(value, (int, float)) and not schema.get("minimum", value) <= value <= schema.get("maximum", value):
        found.append(f"{path}: {value} out of bounds")
    if isinstance(value, dict):
        properties = schema.get("properties", {})
        found += [f"{path}: missing required field {key!r}" for key in schema.get("required", []) if key not in value]
        for key, item in value.items():
            if key in properties:
                found += errors(item, properties[key], f"{path}.{key}")
            elif "additionalProperties" in schema:
                found += errors(item, schema["additionalProperties"], f"{path}.{key}")
            elif not schema.get("x-kubernetes-preserve-unknown-fields"):
                found.append(f"{path}: unknown field {key!r}")
    if isinstance(value, list):
        if len(value) > schema.get("maxItems", len(value)):
            found.append(f"{path}: more than {schema['maxItems']} items")
        for index, item in enumerate(value):
            found += errors(item, schema.get("items", {}), f"{path}[{index}]")
        keys = schema.get("x-kubernetes-list-map-keys") if schema.get("x-kubernetes-list-type") == "map" else None
        entries = [tuple(item.get(key) for key in keys) for item in value] if keys else []
        found += [f"{path}: list-map key {entry} given twice" for entry in set(entries) if entries.count(entry) > 1]
    return found


def object_errors(manifest, crd_schema):
    """The whole object: its metadata as the API server reads ObjectMeta (the CRD schema leaves it
    open), the rest against the CRD's schema."""
    strings = {"type": "object", "additionalProperties": {"type": "string"}}
    metadata = {"type": "object", "required": ["name"],
                "properties": {"name": {"type": "string", "pattern": f"^{DNS_LABEL}$"}, "namespace": {"type": "string"},
                               "labels": strings, "annotations": strings}}  # fmt: skip
    root = {**crd_schema, "properties": {**crd_schema["properties"], "metadata": metadata}}
    return errors(manifest, {**root, "required": ["apiVersion", "kind", "metadata", "spec"]})


def test_manifests_are_valid_for_the_releases_they_target(baked):
    trainjob, jobset = baked["trainjob"], baked["jobset"]
    assert (trainjob["apiVersion"], trainjob["kind"]) == ("trainer.kubeflow.org/v1alpha1", "TrainJob")
    assert object_errors(trainjob, schema("trainjob-v2.3.0.yaml")) == []
    for patch in trainjob["spec"]["runtimePatches"]:  # Trainer's webhook: a domain-prefixed path
        assert re.fullmatch(rf"{DNS_SUBDOMAIN}/[A-Za-z0-9/\-._~%!$&'()*+,;=:]+", patch["manager"]), patch
    assert (jobset["apiVersion"], jobset["kind"]) == ("jobset.x-k8s.io/v1alpha2", "JobSet")
    assert object_errors(jobset, schema("jobset-v0.12.0.yaml")) == []


def test_the_validator_refuses_what_the_api_server_refuses(baked):
    """The check above is only as good as the validator: unknown fields (Trainer v2.1's
    podTemplateOverrides, a misplaced grace period), wrong types, enums and required fields."""
    trainjob, jobset = baked["trainjob"], baked["jobset"]
    spec, trainer, policy = trainjob["spec"], trainjob["spec"]["trainer"], jobset["spec"]["failurePolicy"]
    grace = {**trainer, "terminationGracePeriodSeconds": 90}
    wrong_trainjobs = {
        "$.spec: unknown field 'podTemplateOverrides'": {**spec, "podTemplateOverrides": []},
        "$.spec.trainer: unknown field 'terminationGracePeriodSeconds'": {**spec, "trainer": grace},
        "$.spec.trainer.numNodes: '2' is not of type integer": {**spec, "trainer": {**trainer, "numNodes": "2"}},
        "$.spec.runtimePatches[0]: missing required field 'manager'": {**spec, "runtimePatches": [{}]},
    }
    for error, wrong in wrong_trainjobs.items():
        assert object_errors({**trainjob, "spec": wrong}, schema("trainjob-v2.3.0.yaml")) == [error]
    wrong_rules = {
        "$.spec.failurePolicy.rules[0].action: 'Restart' not in": [{"name": "a", "action": "Restart"}],
        "$.spec.failurePolicy.rules[0]: missing required field 'name'": [{"action": "RestartJobSet"}],
    }
    for error, rules in wrong_rules.items():
        wrong = {**jobset, "spec": {**jobset["spec"], "failurePolicy": {**policy, "rules": rules}}}
        (found,) = object_errors(wrong, schema("jobset-v0.12.0.yaml"))
        assert found.startswith(error), found


def pods(baked):
    """(pod spec, training container, the container's env as the pod gets it) of each manifest."""
    jobset_pod = baked["jobset"]["spec"]["replicatedJobs"][0]["template"]["spec"]["template"]["spec"]
    (patch,) = baked["trainjob"]["spec"]["runtimePatches"]
    (replicated,) = patch["trainingRuntimeSpec"]["template"]["spec"]["replicatedJobs"]
    trainjob_pod = replicated["template"]["spec"]["template"]["spec"]
    return {
        "jobset": (jobset_pod, jobset_pod["containers"][0], jobset_pod["containers"][0]["env"]),
        # Trainer adds the trainer's env to the runtime's container "node", in its order.
        "trainjob": (trainjob_pod, trainjob_pod["containers"][0], baked["trainjob"]["spec"]["trainer"]["env"]),
    }


def test_the_pods_run_as_the_images_user_without_privileges(baked):
    """The Dockerfile's USER (uid:gid) is the pods' runAsUser and runAsGroup, the checkpoint
    volume's fsGroup its group; no capability, no escalation, a read-only root filesystem with
    emptyDirs where the run writes: /tmp and the image's HOME."""
    (uid, gid), *more = re.findall(r"^USER (\d+):(\d+)$", baked["Dockerfile"], re.MULTILINE)
    assert not more and int(uid) >= 10000, uid
    (home,) = re.findall(r"^ENV HOME=(\S+)$", baked["Dockerfile"], re.MULTILINE)
    for name, (pod, container, _) in pods(baked).items():
        context = pod["securityContext"]
        assert context["runAsNonRoot"] is True and context["seccompProfile"] == {"type": "RuntimeDefault"}, name
        assert (context["runAsUser"], context["runAsGroup"], context["fsGroup"]) == (int(uid), int(gid), int(gid))
        assert container["securityContext"] == {"allowPrivilegeEscalation": False, "readOnlyRootFilesystem": True,
                                                "capabilities": {"drop": ["ALL"]}}, name  # fmt: skip
        volumes = {volume["name"]: volume for volume in pod["volumes"]}
        mounts = {mount["mountPath"]: volumes[mount["name"]] for mount in container["volumeMounts"]}
        assert mounts["/tmp"]["emptyDir"] == {} and mounts[home]["emptyDir"] == {}, name


def expanded(env, name, fields):
    """The value Kubernetes gives variable `name` of a container's `env`: fieldRef values from
    `fields`, and $(VAR) replaced by the value of a variable defined before it in the list
    (a later or unknown one stays as written)."""
    values = {}
    for entry in env:
        if "valueFrom" in entry:
            values[entry["name"]] = fields[entry["valueFrom"]["fieldRef"]["fieldPath"]]
        else:
            values[entry["name"]] = re.sub(r"\$\((\w+)\)", lambda m: values.get(m[1], m[0]), entry["value"])
    return values[name]


def test_the_training_job_id_is_the_jobs_namespace_and_name(baked):
    """TRAINING_JOB_ID: the same in every pod of a job and across its restarts (from the
    namespace and the job's name alone: no pod's own field), another for another job (the API
    server keeps names unique in a namespace)."""
    for kind, (_, _, env) in pods(baked).items():
        job_name = baked[kind]["metadata"]["name"]
        for namespace in ("team-a", "team-b"):
            pod_fields = {"metadata.namespace": namespace, "metadata.name": f"{job_name}-node-0-0-x7k2p"}
            assert expanded(env, "TRAINING_JOB_ID", pod_fields) == f"k8s:{namespace}/{job_name}", kind


def without_none(value):
    if isinstance(value, dict):
        return {key: without_none(item) for key, item in value.items() if item is not None}
    return [without_none(item) for item in value] if isinstance(value, list) else value


def lost(sent, kept, path="$"):
    """Where `kept` lacks or changed what was `sent`."""
    if isinstance(sent, dict) and isinstance(kept, dict):
        missing = [f"{path}.{key}" for key in sent if key not in kept]
        return missing + [p for key in sent if key in kept for p in lost(sent[key], kept[key], f"{path}.{key}")]
    if isinstance(sent, list) and isinstance(kept, list) and len(sent) == len(kept):
        return [p for index, pair in enumerate(zip(sent, kept)) for p in lost(*pair, f"{path}[{index}]")]
    return [] if sent == kept else [path]


def test_the_trainjob_round_trips_through_the_trainer_v2_3_0_client(baked):
    """What a client of the API keeps is what the API has: a field it drops (as it drops
    Trainer v2.1's podTemplateOverrides) would never reach the pods."""
    trainjob = baked["trainjob"]
    kept = without_none(TrainerV1alpha1TrainJob.from_dict(trainjob).to_dict())
    assert kept == trainjob, lost(trainjob, kept)


# --- the JobSet's failure policies, as the Job and JobSet controllers apply them -------------


def pod_failure_action(job, exit_codes, conditions=()):
    """The Job's podFailurePolicy for a failed pod whose containers exited with `exit_codes`
    ({container: code}): the first matching rule's action, None (counted toward backoffLimit)
    when no rule matches."""
    for rule in job.get("podFailurePolicy", {}).get("rules", []):
        if "onExitCodes" in rule:
            requirement = rule["onExitCodes"]
            codes = [code for name, code in exit_codes.items() if requirement.get("containerName", name) == name]
            inside = [(code in requirement["values"]) == (requirement["operator"] == "In") for code in codes if code]
            if any(inside):
                return rule["action"]
        patterns = rule.get("onPodConditions", [])
        if any(p["type"] in conditions and p.get("status", "True") == "True" for p in patterns):
            return rule["action"]
    return None


def job_failure_reason(job, exit_codes, conditions=()):
    action = pod_failure_action(job, exit_codes, conditions)
    if action == "FailJob":
        return "PodFailurePolicy"
    assert action is None and job["backoffLimit"] == 0  # any counted pod failure fails the Job
    return "BackoffLimitExceeded"


def jobset_action(jobset, job_name, reason):
    """JobSet's failure policy for a Job failed with `reason`: the first matching rule's action,
    RestartJobSet (counted toward maxRestarts) when none matches."""
    for rule in jobset["spec"]["failurePolicy"].get("rules", []):
        if rule.get("onJobFailureReasons") and reason not in rule["onJobFailureReasons"]:
            continue
        if rule.get("targetReplicatedJobs") and job_name not in rule["targetReplicatedJobs"]:
            continue
        return rule["action"]
    return "RestartJobSet"


def test_a_preemption_restarts_the_jobset_without_counting_and_failures_count(baked):
    jobset = baked["jobset"]
    (replicated,) = jobset["spec"]["replicatedJobs"]
    job, pod = replicated["template"]["spec"], replicated["template"]["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "Never"  # podFailurePolicy requires it
    (container,) = pod["containers"]
    assert jobset["spec"]["failurePolicy"]["maxRestarts"] == 3

    def outcome(code, conditions=()):
        reason = job_failure_reason(job, {container["name"]: code}, conditions)
        return jobset_action(jobset, replicated["name"], reason)

    # Stopped on SIGTERM after its checkpoint (scripts/launch.sh: 128 + 15), or evicted.
    assert outcome(143) == "RestartJobSetAndIgnoreMaxRestarts"
    assert outcome(1, conditions=["DisruptionTarget"]) == "RestartJobSetAndIgnoreMaxRestarts"
    # A crash, a bad config (launch.sh's 2), the OOM killer's SIGKILL: counted.
    for code in (1, 2, 137):
        assert outcome(code) == "RestartJobSet", code
