from llmmesh.runtime import service_main
from services.router.config import SERVICE, RouterConfig
from services.router.server import build_service

if __name__ == "__main__":
    service_main(SERVICE, RouterConfig, build_service)
