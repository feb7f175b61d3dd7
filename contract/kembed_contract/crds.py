"""The CRDs of kembed's custom resources, generated from their pydantic models (kembed_contract.resources).

``python -m kembed_contract.crds`` prints them (``kubectl apply -f -``); ``--chart helm/kembed`` (``make
manifests``) writes them into the Helm chart, and tests/operator/test_manifests.py fails when the committed files
drift from the models.
"""

from __future__ import annotations

import argparse
import copy
import json
import pathlib
import sys
from typing import Any

import yaml
from pydantic import BaseModel

from kembed_contract.resources import (
    EMBEDDING_JOB_KIND,
    EMBEDDING_JOB_PLURAL,
    GROUP,
    TENANT_KIND,
    TENANT_PLURAL,
    VERSION,
    EmbeddingJobSpec,
    EmbeddingJobStatus,
    TenantSpec,
    TenantStatus,
)

__all__ = ["chart_crd_templates", "render_crds", "write_chart_crds"]


# ------------------------------------------------------------------------------------------------ CRD rendering
# What a Kubernetes structural schema keeps of a JSON schema; everything else (title, default, examples, ...) goes.
_KEPT_KEYWORDS = {
    "type", "description", "properties", "required", "items", "enum", "minimum", "maximum", "minLength",
    "maxLength", "pattern", "minItems", "maxItems", "nullable", "additionalProperties",
}


def _structural(schema: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    """One pydantic JSON-schema node as an OpenAPI v3 structural schema (no $ref, no unions, no `const`)."""
    if "$ref" in schema:
        resolved = defs[schema["$ref"].rsplit("/", 1)[1]]
        return _structural({**resolved, **{k: v for k, v in schema.items() if k != "$ref"}}, defs)
    variants = schema.get("anyOf") or schema.get("oneOf")
    if variants:
        non_null = [v for v in variants if v.get("type") != "null"]
        merged = (
            _structural(non_null[0], defs) if len(non_null) == 1 else _merge_variants(non_null, defs)
        )
        if len(non_null) < len(variants):
            merged["nullable"] = True
        if "description" in schema:
            merged["description"] = schema["description"]
        return merged
    out: dict[str, Any] = {}
    for key, value in schema.items():
        if key == "properties":
            out["properties"] = {name: _structural(prop, defs) for name, prop in value.items()}
        elif key == "items":
            out["items"] = _structural(value, defs)
        elif key == "additionalProperties":
            if isinstance(value, dict):  # a map; `false` is implied by pruning and not allowed in CRDs
                out["additionalProperties"] = _structural(value, defs)
        elif key == "const":
            out["enum"] = [value]
        elif key == "exclusiveMinimum":
            out["minimum"], out["exclusiveMinimum"] = value, True
        elif key == "exclusiveMaximum":
            out["maximum"], out["exclusiveMaximum"] = value, True
        elif key in _KEPT_KEYWORDS:
            out[key] = value
    for bound in ("minimum", "maximum"):
        # The API server reads bounds as float64, and ±2**63 - 1 overflows on the way back to an integer (a seed
        # bounded by int64 was refused as "less than or equal to -9223372036854775808"): bounds past 2**53 are
        # left to pydantic, which checks them in the API and the operator anyway.
        if isinstance(out.get(bound), int) and abs(out[bound]) > 2**53:
            del out[bound]
            out.pop(f"exclusive{bound.capitalize()}", None)
    if out.get("type") == "object" and "properties" not in out and "additionalProperties" not in out:
        out["x-kubernetes-preserve-unknown-fields"] = True
    return out


def _merge_variants(variants: list[dict[str, Any]], defs: dict[str, Any]) -> dict[str, Any]:
    """A tagged union (model.kind, data.kind) as one object with every variant's fields.

    Kubernetes cannot express "these fields when kind is X" structurally; pydantic (in the API and again in the
    operator) checks each variant's own rules, the CRD checks types and the set of kinds.
    """
    resolved = [_structural(v, defs) for v in variants]
    if not all(v.get("type") == "object" for v in resolved):
        types = sorted({v.get("type", "?") for v in resolved})
        if set(types) == {"integer", "string"}:
            return {"x-kubernetes-int-or-string": True}
        raise ValueError(f"cannot express a union of {types} in a CRD schema")
    properties: dict[str, Any] = {}
    for variant in resolved:
        for name, prop in variant.get("properties", {}).items():
            if name in properties and "enum" in prop and "enum" in properties[name]:
                properties[name] = {**properties[name], "enum": properties[name]["enum"] + prop["enum"]}
            else:
                properties.setdefault(name, prop)
    required = set.intersection(*(set(v.get("required", [])) for v in resolved))
    merged: dict[str, Any] = {"type": "object", "properties": properties}
    if required:
        merged["required"] = sorted(required)
    return merged


def _openapi(model: type[BaseModel], *, by_alias: bool) -> dict[str, Any]:
    schema = model.model_json_schema(by_alias=by_alias, mode="validation")
    return _structural(schema, schema.get("$defs", {}))


def _status_schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = _openapi(model, by_alias=True)
    # The status is written by the operator only; unknown fields there are pruned like anywhere else.
    schema.pop("required", None)
    return schema


def _crd(*, kind: str, plural: str, singular: str, scope: str, short_names: list[str], spec_model: type[BaseModel],
         status_model: type[BaseModel], columns: list[dict[str, Any]]) -> dict[str, Any]:
    spec_schema = _openapi(spec_model, by_alias=False)
    return {
        "apiVersion": "apiextensions.k8s.io/v1",
        "kind": "CustomResourceDefinition",
        "metadata": {"name": f"{plural}.{GROUP}"},
        "spec": {
            "group": GROUP,
            "scope": scope,
            "names": {"kind": kind, "plural": plural, "singular": singular, "shortNames": short_names,
                      "categories": ["kembed"]},
            "versions": [{
                "name": VERSION, "served": True, "storage": True,
                "subresources": {"status": {}},
                "additionalPrinterColumns": columns,
                "schema": {"openAPIV3Schema": {
                    "type": "object",
                    "description": (spec_model.__doc__ or kind).strip().splitlines()[0],
                    "required": ["spec"],
                    "properties": {
                        "apiVersion": {"type": "string"}, "kind": {"type": "string"},
                        "metadata": {"type": "object"},
                        "spec": spec_schema,
                        "status": _status_schema(status_model),
                    },
                }},
            }],
        },
    }


def render_crds() -> list[dict[str, Any]]:
    """The CustomResourceDefinitions of Tenant and EmbeddingJob, generated from the models above."""
    tenant = _crd(
        kind=TENANT_KIND, plural=TENANT_PLURAL, singular="tenant", scope="Cluster", short_names=["kt"],
        spec_model=TenantSpec, status_model=TenantStatus,
        columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Namespace", "type": "string", "jsonPath": ".status.namespace"},
            {"name": "Cohort", "type": "string", "jsonPath": ".spec.sharing.cohort"},
            {"name": "GPUs", "type": "integer", "jsonPath": ".spec.quota.gpus",
             "description": "Nominal (guaranteed) GPUs; empty: unlimited."},
            {"name": "Used", "type": "number", "jsonPath": ".status.usage.used.gpus",
             "description": "GPUs its admitted jobs hold (written by the API)."},
            {"name": "Borrowed", "type": "number", "jsonPath": ".status.usage.borrowed.gpus",
             "description": "GPUs it holds beyond its quota, borrowed from its cohort."},
            {"name": "Lent", "type": "number", "jsonPath": ".status.usage.lent.gpus",
             "description": "Its idle GPUs that other members of its cohort borrow."},
            {"name": "Queued", "type": "integer", "jsonPath": ".status.usage.queuedJobs"},
            {"name": "CPU", "type": "number", "jsonPath": ".spec.quota.cpu", "priority": 1},
            {"name": "Used CPU", "type": "number", "jsonPath": ".status.usage.used.cpu", "priority": 1},
            {"name": "Borrowed CPU", "type": "number", "jsonPath": ".status.usage.borrowed.cpu", "priority": 1},
            {"name": "Lent CPU", "type": "number", "jsonPath": ".status.usage.lent.cpu", "priority": 1},
            {"name": "Max Jobs", "type": "integer", "jsonPath": ".spec.quota.max_running_jobs", "priority": 1},
            {"name": "Running", "type": "integer", "jsonPath": ".status.usage.used.runningJobs", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )
    job = _crd(
        kind=EMBEDDING_JOB_KIND, plural=EMBEDDING_JOB_PLURAL, singular="embeddingjob", scope="Namespaced",
        short_names=["ej"], spec_model=EmbeddingJobSpec, status_model=EmbeddingJobStatus,
        columns=[
            {"name": "Phase", "type": "string", "jsonPath": ".status.phase"},
            {"name": "Progress", "type": "integer", "jsonPath": ".status.progress.percent",
             "description": "Percent of training steps done."},
            {"name": "Restarts", "type": "integer", "jsonPath": ".status.restartCount"},
            {"name": "Nodes", "type": "integer", "jsonPath": ".spec.resources.nodes"},
            {"name": "Reason", "type": "string", "jsonPath": ".status.reason", "priority": 1},
            {"name": "Age", "type": "date", "jsonPath": ".metadata.creationTimestamp"},
        ],
    )
    # Plain trees, no part shared: YAML would write a shared part once with an anchor (&id001) and alias it.
    return json.loads(json.dumps([tenant, job]))


# ------------------------------------------------------------------------------------------------ chart files
_CHART_HEADER = (
    "# Generated by `python -m kembed_contract.crds --chart helm/kembed` (make manifests) from "
    "contract/kembed_contract/resources.py.\n# Do not edit: change the pydantic models and regenerate; a test fails on "
    "drift.\n"
)


def chart_crd_templates() -> dict[str, str]:
    """The chart's CRD templates (file name -> text): installed when .Values.crds.install, kept on uninstall
    when .Values.crds.keep."""
    files = {}
    for crd in render_crds():
        body = copy.deepcopy(crd)
        body["metadata"]["annotations"] = {"KEEP_PLACEHOLDER": "x"}
        text = yaml.safe_dump(body, sort_keys=False, width=120)
        text = text.replace(
            "  annotations:\n    KEEP_PLACEHOLDER: x\n",
            "  annotations:\n    {{- if .Values.crds.keep }}\n    helm.sh/resource-policy: keep\n    {{- end }}\n"
            "  labels:\n    {{- include \"kembed.labels\" . | nindent 4 }}\n",
        )
        plural = crd["spec"]["names"]["plural"]
        files[f"crd-{plural}.yaml"] = (
            f"{_CHART_HEADER}{{{{- if .Values.crds.install }}}}\n{text}{{{{- end }}}}\n"
        )
    return files


def write_chart_crds(chart_dir: pathlib.Path) -> list[pathlib.Path]:
    target = chart_dir / "templates" / "crds"
    target.mkdir(parents=True, exist_ok=True)
    written = []
    for name, text in chart_crd_templates().items():
        (target / name).write_text(text)
        written.append(target / name)
    return written



def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m kembed_contract.crds",
                                     description="Print the kembed CRDs as YAML (kubectl apply -f -).")
    parser.add_argument("--chart", type=pathlib.Path, help="write the CRD templates into this chart instead")
    args = parser.parse_args(argv)
    if args.chart:
        for path in write_chart_crds(args.chart):
            print(path, file=sys.stderr)
    else:
        yaml.safe_dump_all(render_crds(), sys.stdout, sort_keys=False, width=120)
    return 0


if __name__ == "__main__":
    sys.exit(main())
