"""Read Kubernetes manifests as JSON, and validate them against Kubernetes' own schemas offline.

Usage: k8s_manifests.py DIR VERSION [VERSION ...]   (a VERSION may be `latest`)

Prints one JSON object: `files` maps each `*.yaml` in DIR to its documents; `checked` lists
(file, kind, name, version) for every document validated; `errors` lists what failed, and
`skipped` the documents no shipped schema covers (custom resources such as PodMonitor, and
kustomize's Kustomization). Validation is strict: an unknown field is an error. Driven by
tests/deploy.rs, which makes the assertions; needs `kubernetes-validate` (it brings PyYAML).
"""

import json
import pathlib
import sys

import kubernetes_validate
import yaml


def main() -> int:
    directory = pathlib.Path(sys.argv[1])
    versions = sys.argv[2:]
    shipped = set(kubernetes_validate.utils.all_versions())
    actual = {v: kubernetes_validate.latest_version() if v == "latest" else v for v in versions}
    missing = [v for v in versions if actual[v] not in shipped]
    if missing or not versions:
        print(f"kubernetes-validate {kubernetes_validate.__version__} has no schemas for "
              f"{missing or 'no version given'}; it ships {sorted(shipped)}", file=sys.stderr)
        return 2
    out = {"files": {}, "checked": [], "errors": [], "skipped": []}
    for path in sorted(directory.glob("*.yaml")):
        docs = [d for d in yaml.safe_load_all(path.read_text()) if d is not None]
        out["files"][path.name] = docs
        for doc in docs:
            kind, name = doc.get("kind"), doc.get("metadata", {}).get("name")
            for version in versions:
                where = {"file": path.name, "kind": kind, "name": name, "version": version}
                try:
                    kubernetes_validate.validate(doc, actual[version], strict=True)
                    out["checked"].append(where)
                except kubernetes_validate.SchemaNotFoundError:
                    if where not in out["skipped"]:
                        out["skipped"].append({**where, "version": None})
                except kubernetes_validate.ValidationError as e:
                    path_in_doc = ".".join(str(p) for p in e.path)
                    out["errors"].append({**where, "error": f"{path_in_doc}: {e.message}"})
                except kubernetes_validate.InvalidSchemaError as e:
                    out["errors"].append({**where, "error": f"invalid schema: {e}"})
    # Skipped documents appear once per version; keep one.
    out["skipped"] = [dict(t) for t in {tuple(sorted(s.items())) for s in out["skipped"]}]
    json.dump(out, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())
