"""virt"""
