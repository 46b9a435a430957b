"""kuangchao_core.hal"""
