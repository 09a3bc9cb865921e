"""Put the keyring ``tandem auth init`` wrote into a Kubernetes Secret, once (the tandem-auth-init Job).

    python3 make_secret.py FOLDER SECRET [--account-dir DIR]

Makes the Secret SECRET in this pod's namespace with one key per file of FOLDER (``nats-auth.conf``
and ``<role>.key``). A Secret of that name that already holds every one of those keys is kept as it
is, as ``tandem auth init --keep`` keeps a complete folder: the keyring in use is never replaced by
a re-run. One that lacks some is an error (delete it to make a new keyring; every pod then needs a
restart). Talks to the API server as the pod's service account, with the standard library only, so
it runs in the tandem image as it is.
"""

from __future__ import annotations

import base64
import json
import os
import ssl
import sys
import urllib.error
import urllib.request
from pathlib import Path

ACCOUNT_DIR = Path("/var/run/secrets/kubernetes.io/serviceaccount")


def call(method: str, url: str, token: str, context: ssl.SSLContext, body: dict | None = None) -> tuple[int, dict]:
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers={
        "Authorization": f"Bearer {token}", "Accept": "application/json", "Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as answer:
            return answer.status, json.loads(answer.read() or b"{}")
    except urllib.error.HTTPError as refused:
        try:
            return refused.code, json.loads(refused.read() or b"{}")
        except ValueError:
            return refused.code, {}


def main(argv: list[str]) -> int:
    account = ACCOUNT_DIR
    if "--account-dir" in argv:
        at = argv.index("--account-dir")
        account, argv = Path(argv[at + 1]), argv[:at] + argv[at + 2:]
    if len(argv) != 2:
        print(__doc__.split("\n\n")[1].strip(), file=sys.stderr)
        return 2
    folder, name = Path(argv[0]), argv[1]
    files = {p.name: p.read_bytes() for p in sorted(folder.iterdir()) if p.is_file()}
    if not files:
        print(f"make_secret: {folder} holds no keyring (run tandem auth init first)", file=sys.stderr)
        return 1
    host, port = os.environ.get("KUBERNETES_SERVICE_HOST", ""), os.environ.get("KUBERNETES_SERVICE_PORT", "443")
    if not host:
        print("make_secret: not in a pod (KUBERNETES_SERVICE_HOST is unset)", file=sys.stderr)
        return 1
    base = f"https://{f'[{host}]' if ':' in host else host}:{port}"
    token = (account / "token").read_text().strip()
    namespace = (account / "namespace").read_text().strip()
    context = ssl.create_default_context(cafile=str(account / "ca.crt"))
    secrets = f"{base}/api/v1/namespaces/{namespace}/secrets"
    body = {"apiVersion": "v1", "kind": "Secret", "type": "Opaque",
            "metadata": {"name": name, "labels": {"app.kubernetes.io/part-of": "tandem",
                                                  "app.kubernetes.io/component": "auth"}},
            "data": {key: base64.b64encode(value).decode() for key, value in files.items()}}
    status, answer = call("POST", secrets, token, context, body)
    if status == 201:
        print(f"make_secret: made Secret {name} in {namespace}: {', '.join(files)}")
        return 0
    if status != 409:
        print(f"make_secret: creating Secret {name} in {namespace}: {status} {answer.get('message', '')}",
              file=sys.stderr)
        return 1
    status, existing = call("GET", f"{secrets}/{name}", token, context)
    if status != 200:
        print(f"make_secret: Secret {name} exists but cannot be read: {status} {existing.get('message', '')}",
              file=sys.stderr)
        return 1
    missing = sorted(set(files) - set(existing.get("data") or {}))
    if missing:
        print(f"make_secret: Secret {name} in {namespace} lacks {', '.join(missing)}; delete it to make a new "
              "keyring (then restart every tandem pod)", file=sys.stderr)
        return 1
    print(f"make_secret: Secret {name} in {namespace} already holds a keyring; kept as it is")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
