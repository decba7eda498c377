"""Generated code for the llmmesh.v1 protos (``make protos``); do not edit the *_pb2 files.

Public API::

    from llmmesh.v1 import generation_pb2, generation_pb2_grpc
"""
