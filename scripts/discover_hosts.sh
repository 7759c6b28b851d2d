#!/bin/sh
# Horovod elastic host discovery for one machine (labs/elastic.py): prints the lines of
# $HVDC_HOSTS_FILE ("host:slots" each). Edit the file while the job runs to take a slot away
# or give it back; on one machine give each slot a name of its own (localhost, 127.0.0.1,
# the host name), since Horovod blacklists a whole host when one of its workers fails.
exec cat "${HVDC_HOSTS_FILE:?set HVDC_HOSTS_FILE to a file of host:slots lines}"
