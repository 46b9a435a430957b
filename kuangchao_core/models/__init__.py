"""kuangchao_core.models"""
