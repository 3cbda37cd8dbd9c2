"""The etcd3 rendezvous: its protocol, its pure decisions, torch's handler and backend."""
