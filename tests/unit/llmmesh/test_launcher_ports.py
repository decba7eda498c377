"""Free ports for side-by-side stacks: one set never overlaps another chosen before it."""

from __future__ import annotations

from dataclasses import astuple

from llmmesh.launcher.process import free_ports
from llmmesh.launcher.sidecars import SidecarPorts
from llmmesh.launcher.stack import StackPorts


def test_free_ports_are_distinct_and_avoid_the_excluded() -> None:
    taken = set(free_ports(200))  # closed again: the OS may hand any of them out
    ports = free_ports(20, exclude=taken)
    assert len(set(ports)) == 20
    assert not set(ports) & taken


def test_sidecar_ports_avoid_the_services_ports() -> None:
    services = StackPorts.free()
    sidecars = SidecarPorts.free(exclude=astuple(services))
    chosen = [*sidecars.inbound.values(), *sidecars.admin.values()]
    chosen += sidecars.router_upstreams.values()
    assert len(set(chosen)) == len(chosen)
    assert not set(chosen) & set(astuple(services))
