// A kubelet-side caller for the benchmark: grpc-go, as in the kubelet's device manager.
// It dials the plugin's unix socket the way the kubelet does and times unary calls.
//
//	grpc_go_client SOCKET METHOD[,METHOD...] REQUEST_HEX|@FILE[,...] CALLS CONCURRENCY [WARMUP]
//
// Several methods (and as many requests) make one timed call a sequence, one after the other, as the
// kubelet calls GetPreferredAllocation and then Allocate for one container. WARMUP calls (default
// 200) go first, untimed.
//
// prints: p50_seconds p99_seconds calls_per_second
package main

import (
	"context"
	"encoding/hex"
	"fmt"
	"io/ioutil"
	"net"
	"os"
	"sort"
	"strconv"
	"strings"
	"sync"
	"time"

	"google.golang.org/grpc"
)

// rawCodec sends and receives serialized protobuf bytes as they are: the request is built by the
// Python side, and the response is only timed, never read.
type rawCodec struct{}

func (rawCodec) Marshal(v interface{}) ([]byte, error) { return *(v.(*[]byte)), nil }
func (rawCodec) Unmarshal(data []byte, v interface{}) error {
	*(v.(*[]byte)) = append((*(v.(*[]byte)))[:0], data...)
	return nil
}
func (rawCodec) Name() string { return "proto" }

func main() {
	if len(os.Args) != 6 && len(os.Args) != 7 {
		fmt.Fprintln(os.Stderr, "usage: grpc_go_client SOCKET METHOD[,...] REQUEST_HEX|@FILE[,...] CALLS CONCURRENCY [WARMUP]")
		os.Exit(2)
	}
	socket, methods := os.Args[1], strings.Split(os.Args[2], ",")
	hexRequests := strings.Split(os.Args[3], ",")
	if len(hexRequests) != len(methods) {
		fmt.Fprintln(os.Stderr, "grpc_go_client: one request per method")
		os.Exit(2)
	}
	var requests [][]byte
	for _, hexRequest := range hexRequests {
		if strings.HasPrefix(hexRequest, "@") {
			// A request larger than one argument may be (the kernel's 128 KiB), e.g. a
			// GetPreferredAllocation with 10,000 available IDs: its hex read from the file named.
			data, err := ioutil.ReadFile(hexRequest[1:])
			check(err)
			hexRequest = strings.TrimSpace(string(data))
		}
		request, err := hex.DecodeString(hexRequest)
		check(err)
		requests = append(requests, request)
	}
	calls, err := strconv.Atoi(os.Args[4])
	check(err)
	concurrency, err := strconv.Atoi(os.Args[5])
	check(err)
	warmup := 200
	if len(os.Args) == 7 {
		warmup, err = strconv.Atoi(os.Args[6])
		check(err)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	conn, err := grpc.DialContext(ctx, socket, grpc.WithInsecure(), grpc.WithBlock(),
		grpc.WithAuthority("localhost"),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			return (&net.Dialer{}).DialContext(ctx, "unix", addr)
		}))
	check(err)
	defer conn.Close()

	call := func() time.Duration {
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		var response []byte
		start := time.Now()
		for i, method := range methods {
			check(conn.Invoke(ctx, method, &requests[i], &response, grpc.ForceCodec(rawCodec{})))
		}
		return time.Since(start)
	}
	for i := 0; i < warmup; i++ { // warm up: connection windows, hpack tables
		call()
	}

	latencies := make([]time.Duration, 0, calls)
	var lock sync.Mutex
	var wg sync.WaitGroup
	start := time.Now()
	for w := 0; w < concurrency; w++ {
		wg.Add(1)
		go func() {
			defer wg.Done()
			mine := make([]time.Duration, 0, calls/concurrency)
			for i := 0; i < calls/concurrency; i++ {
				mine = append(mine, call())
			}
			lock.Lock()
			latencies = append(latencies, mine...)
			lock.Unlock()
		}()
	}
	wg.Wait()
	elapsed := time.Since(start)
	sort.Slice(latencies, func(i, j int) bool { return latencies[i] < latencies[j] })
	at := func(f float64) float64 { return latencies[int(f*float64(len(latencies)-1))].Seconds() }
	fmt.Printf("%.6f %.6f %.1f\n", at(0.5), at(0.99), float64(len(latencies))/elapsed.Seconds())
}

func check(err error) {
	if err != nil {
		fmt.Fprintln(os.Stderr, "grpc_go_client:", err)
		os.Exit(1)
	}
}
