"""hostagent: lease whole GPUs to KVM/libvirt guests over VFIO passthrough."""

__version__ = "0.1.0"
