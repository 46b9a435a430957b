"""kuangchao_core.comm"""
