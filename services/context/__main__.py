from llmmesh.runtime import service_main
from services.context.config import SERVICE, ContextConfig
from services.context.server import build_service

if __name__ == "__main__":
    service_main(SERVICE, ContextConfig, build_service)
