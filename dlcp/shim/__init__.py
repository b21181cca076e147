"""dlcp.shim"""
