"""Generated gRPC stubs (scripts/gen_proto.sh); never edit by hand."""
