from llmmesh.runtime import service_main
from services.policy.config import SERVICE, PolicyConfig
from services.policy.server import build_service

if __name__ == "__main__":
    service_main(SERVICE, PolicyConfig, build_service)
