#!/usr/bin/env sh
# Seeds the KV keys the router and policy read. Needs the consul CLI and CONSUL_HTTP_ADDR
# (and CONSUL_HTTP_TOKEN with ACLs on). Keys that exist are left alone unless FORCE=1.
set -eu
here=$(cd "$(dirname "$0")" && pwd)
repo=$(cd "$here/../.." && pwd)

put() {  # key file
  if [ "${FORCE:-0}" = 1 ] || ! consul kv get "$1" >/dev/null 2>&1; then
    consul kv put "$1" "@$2"
  else
    echo "kept $1 (FORCE=1 overwrites)"
  fi
}

put llm-mesh/routing "$here/kv/llm-mesh/routing.json"
put llm-mesh/tenants "$here/kv/llm-mesh/tenants.yaml"
put llm-mesh/policy/default "$repo/services/policy/default_rules.yaml"
