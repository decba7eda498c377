#!/bin/sh
# Registers $REGISTRATION (a file of mesh/consul/services) for the service at
# $SERVICE_HOST, then runs its Envoy sidecar through `consul connect envoy` as the envoy
# user. With TRANSPARENT=1 the network namespace it shares with its service first gets
# Consul's iptables rules (needs NET_ADMIN): the service's outbound calls then go through
# Envoy without the service knowing.
set -eu
: "${CONSUL_HTTP_ADDR:?}" "${REGISTRATION:?}" "${SERVICE_HOST:?}"
envoy_uid=101
registration=/tmp/registration.json
# The files name 127.0.0.1 (an agent on the service's host); in compose the service has
# a host of its own.
sed -e "s/\"port\": /\"address\": \"${SERVICE_HOST}\", \"port\": /" \
    -e "s/127\.0\.0\.1:/${SERVICE_HOST}:/" \
    "/mesh/services/${REGISTRATION}" > "$registration"
until consul services register "$registration"; do sleep 1; done
service_id=$(sed -n 's/.*"id": "\([^"]*\)".*/\1/p' "$registration" | head -n 1)
if [ "${TRANSPARENT:-0}" = 1 ]; then
  consul connect redirect-traffic -proxy-id "${service_id}-sidecar-proxy" -proxy-uid "$envoy_uid"
fi
exec setpriv --reuid "$envoy_uid" --regid "$envoy_uid" --clear-groups \
  consul connect envoy -sidecar-for "$service_id" -grpc-addr "${CONSUL_GRPC_ADDR:-consul:8502}" \
  -admin-bind 127.0.0.1:19000 -- --log-level warn
