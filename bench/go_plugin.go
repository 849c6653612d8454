// A Go device plugin for the benchmark to compare gopherplug against: grpc-go serving the v1beta1
// DevicePlugin service on a unix socket, as the kubelet's own test stub does (kubernetes/kubernetes
// pkg/kubelet/cm/devicemanager/plugin/v1beta1/stub.go), answering what gopherplug answers for the
// same directory of plain files configured with one device_spec. Usage:
//
//	go_plugin SOCKET DIRECTORY ENV [log]
//
// The devices are the entries of DIRECTORY, listed once at start (the stub keeps a fixed list).
// Allocate answers, per container, ENV=the IDs comma-joined and a DeviceSpec per device (host and
// container path DIRECTORY/ID, permissions "rw"); an ID that is not a device is INVALID_ARGUMENT.
// GetPreferredAllocation answers, per container, the must-include IDs, then the available ones in
// the order given, until allocation_size (the stub's hook answers whatever a test sets; this is the
// cheapest correct answer, what a plugin without topology can do). GetDevicePluginOptions says
// GetPreferredAllocation is available; ListAndWatch sends the list once and stays open;
// PreStartContainer answers empty.
//
// It does not register with a kubelet: the benchmark dials its socket, as the kubelet would after
// Register. It writes no log line per call, unless its fourth argument is "log": then one line per
// call on stderr, as the stub writes one with klog.InfoS("Allocate", "request", r) (here the standard
// library's log: date, microseconds, the caller's file and line, the method and the request). gopherplug
// is measured at its default level, info, which logs each Allocate: see bench_side_by_side.py.
//
// No generated code: the messages are encoded and decoded here by hand. The project commits no
// generated files, and generating at bench time would need protoc and protoc-gen-go, which Debian's
// golang-google-grpc-dev does not bring. The wire format of these messages is small (see
// https://protobuf.dev/programming-guides/encoding/): every field used is a length-delimited string
// or sub-message (wire type 2), a varint (wire type 0), or a map entry (a sub-message of key = 1,
// value = 2). Decoding makes a Go string of every ID, as generated code would; what it skips is
// golang/protobuf's generic (reflective) decoder, so if anything these figures are a little lower
// than a generated plugin's: the ratios to them do not flatter gopherplug.
package main

import (
	"context"
	"errors"
	"fmt"
	"io/ioutil"
	"log"
	"net"
	"os"
	"path/filepath"
	"strings"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
)

// rawCodec hands the handlers the request's bytes and sends the bytes they return: the messages are
// (de)serialized by the handlers themselves.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append((*(v.(*[]byte)))[:0], data...)
	return nil
}
func (rawCodec) String() string { return "proto" }

// --- the protobuf wire format, the few parts these messages use ---

func appendVarint(b []byte, v uint64) []byte {
	for v >= 0x80 {
		b = append(b, byte(v)|0x80)
		v >>= 7
	}
	return append(b, byte(v))
}

// appendBytes appends field `number` as a length-delimited field (wire type 2).
func appendBytes(b []byte, number int, value []byte) []byte {
	b = appendVarint(b, uint64(number)<<3|2)
	b = appendVarint(b, uint64(len(value)))
	return append(b, value...)
}

func appendString(b []byte, number int, value string) []byte {
	b = appendVarint(b, uint64(number)<<3|2)
	b = appendVarint(b, uint64(len(value)))
	return append(b, value...)
}

var errTruncated = errors.New("truncated message")

func readVarint(b []byte) (uint64, int, error) {
	var v uint64
	for i := 0; i < len(b) && i < 10; i++ {
		v |= uint64(b[i]&0x7f) << (7 * uint(i))
		if b[i] < 0x80 {
			return v, i + 1, nil
		}
	}
	return 0, 0, errTruncated
}

// fields calls visit(number, wireType, varint, bytes) for each field of a message.
func fields(b []byte, visit func(number int, wire int, varint uint64, data []byte) error) error {
	for len(b) > 0 {
		key, n, err := readVarint(b)
		if err != nil {
			return err
		}
		b = b[n:]
		number, wire := int(key>>3), int(key&7)
		switch wire {
		case 0:
			v, n, err := readVarint(b)
			if err != nil {
				return err
			}
			b = b[n:]
			if err := visit(number, wire, v, nil); err != nil {
				return err
			}
		case 2:
			length, n, err := readVarint(b)
			if err != nil || uint64(len(b)-n) < length {
				return errTruncated
			}
			if err := visit(number, wire, 0, b[n:n+int(length)]); err != nil {
				return err
			}
			b = b[n+int(length):]
		case 1:
			if len(b) < 8 {
				return errTruncated
			}
			b = b[8:]
		case 5:
			if len(b) < 4 {
				return errTruncated
			}
			b = b[4:]
		default:
			return fmt.Errorf("wire type %d not supported", wire)
		}
	}
	return nil
}

// containers decodes repeated field 1 (container_requests) of AllocateRequest or
// PreferredAllocationRequest: each one's sub-message bytes.
func containers(request []byte) ([][]byte, error) {
	var out [][]byte
	err := fields(request, func(number, wire int, _ uint64, data []byte) error {
		if number == 1 && wire == 2 {
			out = append(out, data)
		}
		return nil
	})
	return out, err
}

// --- the plugin ---

type plugin struct {
	directory string
	env       string
	ids       []string
	known     map[string]bool
}

func (p *plugin) allocate(request []byte) ([]byte, error) {
	requests, err := containers(request)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	if len(requests) == 0 {
		return nil, status.Error(codes.InvalidArgument, "AllocateRequest has no container requests")
	}
	var response []byte
	for _, container := range requests {
		var ids []string
		err := fields(container, func(number, wire int, _ uint64, data []byte) error {
			if number == 1 && wire == 2 { // devices_ids
				ids = append(ids, string(data))
			}
			return nil
		})
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		var answer []byte
		var entry []byte // envs is a map<string, string>: an entry {key = 1, value = 2} each
		entry = appendString(entry, 1, p.env)
		entry = appendString(entry, 2, strings.Join(ids, ","))
		answer = appendBytes(answer, 1, entry)
		for _, id := range ids {
			if !p.known[id] {
				return nil, status.Errorf(codes.InvalidArgument, "unknown device ID: %s", id)
			}
			path := filepath.Join(p.directory, id)
			var spec []byte // DeviceSpec {container_path = 1, host_path = 2, permissions = 3}
			spec = appendString(spec, 1, path)
			spec = appendString(spec, 2, path)
			spec = appendString(spec, 3, "rw")
			answer = appendBytes(answer, 3, spec) // ContainerAllocateResponse.devices = 3
		}
		response = appendBytes(response, 1, answer) // AllocateResponse.container_responses = 1
	}
	return response, nil
}

func (p *plugin) preferred(request []byte) ([]byte, error) {
	requests, err := containers(request)
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	var response []byte
	for _, container := range requests {
		var available, mustInclude []string
		size := 0
		err := fields(container, func(number, wire int, varint uint64, data []byte) error {
			switch {
			case number == 1 && wire == 2: // available_deviceIDs
				available = append(available, string(data))
			case number == 2 && wire == 2: // must_include_deviceIDs
				mustInclude = append(mustInclude, string(data))
			case number == 3 && wire == 0: // allocation_size
				size = int(int32(varint))
			}
			return nil
		})
		if err != nil {
			return nil, status.Error(codes.Internal, err.Error())
		}
		chosen := make(map[string]bool, size)
		var answer []byte
		for _, list := range [][]string{mustInclude, available} {
			for _, id := range list {
				if len(chosen) >= size {
					break
				}
				if !chosen[id] {
					chosen[id] = true
					answer = appendString(answer, 1, id) // deviceIDs = 1
				}
			}
		}
		response = appendBytes(response, 1, answer)
	}
	return response, nil
}

func (p *plugin) list() []byte {
	var response []byte
	for _, id := range p.ids {
		var device []byte // Device {ID = 1, health = 2}
		device = appendString(device, 1, id)
		device = appendString(device, 2, "Healthy")
		response = appendBytes(response, 1, device)
	}
	return response
}

// unary makes a grpc.MethodDesc of a handler over raw bytes.
func unary(name string, answer func(p *plugin, request []byte) ([]byte, error)) grpc.MethodDesc {
	return grpc.MethodDesc{
		MethodName: name,
		Handler: func(srv interface{}, _ context.Context, decode func(interface{}) error,
			_ grpc.UnaryServerInterceptor) (interface{}, error) {
			var request []byte
			if err := decode(&request); err != nil {
				return nil, err
			}
			if logCalls {
				log.Printf("%s request=%q", name, request)
			}
			response, err := answer(srv.(*plugin), request)
			if err != nil {
				return nil, err
			}
			return &response, nil
		},
	}
}

var logCalls = false // the fourth argument, "log": a line per call, as the stub writes

func main() {
	log.SetFlags(log.Ldate | log.Lmicroseconds | log.Lshortfile)
	if len(os.Args) != 4 && (len(os.Args) != 5 || os.Args[4] != "log") {
		fmt.Fprintln(os.Stderr, "usage: go_plugin SOCKET DIRECTORY ENV [log]")
		os.Exit(2)
	}
	logCalls = len(os.Args) == 5
	socket, directory, env := os.Args[1], os.Args[2], os.Args[3]
	entries, err := ioutil.ReadDir(directory)
	check(err)
	p := &plugin{directory: directory, env: env, known: make(map[string]bool, len(entries))}
	for _, entry := range entries {
		p.ids = append(p.ids, entry.Name())
		p.known[entry.Name()] = true
	}
	options := []byte{0x10, 0x01} // DevicePluginOptions{get_preferred_allocation_available = 2: true}

	service := grpc.ServiceDesc{
		ServiceName: "v1beta1.DevicePlugin",
		HandlerType: (*interface{})(nil),
		Methods: []grpc.MethodDesc{
			unary("GetDevicePluginOptions", func(*plugin, []byte) ([]byte, error) { return options, nil }),
			unary("Allocate", (*plugin).allocate),
			unary("GetPreferredAllocation", (*plugin).preferred),
			unary("PreStartContainer", func(*plugin, []byte) ([]byte, error) { return []byte{}, nil }),
		},
		Streams: []grpc.StreamDesc{{
			StreamName:    "ListAndWatch",
			ServerStreams: true,
			Handler: func(srv interface{}, stream grpc.ServerStream) error {
				var empty []byte
				if err := stream.RecvMsg(&empty); err != nil {
					return err
				}
				list := srv.(*plugin).list()
				if err := stream.SendMsg(&list); err != nil {
					return err
				}
				<-stream.Context().Done() // held open until the client leaves, as the kubelet's stream is
				return nil
			},
		}},
	}
	os.Remove(socket)
	listener, err := net.Listen("unix", socket)
	check(err)
	server := grpc.NewServer(grpc.CustomCodec(rawCodec{}))
	server.RegisterService(&service, p)
	fmt.Println("serving") // the benchmark waits for this line before dialing
	check(server.Serve(listener))
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "go_plugin:", err)
		os.Exit(1)
	}
}
