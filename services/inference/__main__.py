from llmmesh.runtime import service_main
from services.inference.config import SERVICE, InferenceConfig
from services.inference.server import build_service

if __name__ == "__main__":
    service_main(SERVICE, InferenceConfig, build_service)
