"""dlcp.daemon"""
